//! Chat templates (Jinja, as Hugging Face writes them) rendered with minijinja and its
//! Python-compatibility methods (`.strip()`, `.items()`, ...).

use anyhow::{anyhow, Result};
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

/// The template of a family whose GGUF files often carry none (llama.cpp's converter wrote
/// Gemma 3 270M without one), by `general.architecture`.
pub fn builtin(architecture: &str) -> Option<&'static str> {
    match architecture {
        "gemma" | "gemma2" | "gemma3" => Some(include_str!("../templates/gemma.jinja")),
        _ => None,
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template renders a `tools` variable at all.
    renders_tools: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

fn raise_exception(msg: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Whether tools passed to [`ChatTemplate::render`] reach the prompt (many templates,
    /// SmolLM2's among them, have no tools section).
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| anyhow!("invalid chat template: {e}"))?;
        Ok(Self {
            renders_tools: source.contains("tools"),
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages` (any serializable list) with extra template variables.
    pub fn render<M: Serialize>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: Value,
    ) -> Result<String> {
        let tmpl = self.env.get_template("chat")?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
            ..extra
        };
        tmpl.render(ctx)
            .map_err(|e| anyhow!("chat template failed: {e}"))
    }
}

/// `rendered` cut right after the final message's text, so that generation continues that
/// message instead of starting a turn (transformers' `continue_final_message`): templates
/// close every turn they render. The text is found trimmed, as templates often strip it.
pub fn open_final_message(rendered: &str, final_text: &str) -> Result<String> {
    let trimmed = final_text.trim();
    if trimmed.is_empty() {
        return Err(anyhow!(
            "continue_final_message needs a final message with text to continue"
        ));
    }
    let at = rendered.rfind(trimmed).ok_or_else(|| {
        anyhow!(
            "continue_final_message is set, but the chat template does not render the final \
             message's text as given, so it cannot be continued"
        )
    })?;
    // Trailing spaces the template kept are kept; ones it stripped are not added back.
    let kept = match rendered[at..].starts_with(final_text.trim_start()) {
        true => final_text.trim_start().len(),
        false => trimmed.len(),
    };
    Ok(rendered[..at + kept].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_hf_style_template_with_python_methods() {
        let src = "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into()).unwrap();
        let msgs = vec![ChatMessage {
            role: "user".into(),
            content: "  hi  ".into(),
        }];
        let out = t.render(&msgs, true, Value::UNDEFINED).unwrap();
        assert_eq!(out, "<|user|>hi\n<|assistant|>");
    }

    #[test]
    fn the_final_message_is_left_open() {
        let closed = "<|im_start|>assistant\nHello there, my<|im_end|>\n";
        let open = open_final_message(closed, "Hello there, my").unwrap();
        assert_eq!(open, "<|im_start|>assistant\nHello there, my");
        // A trailing space the template kept stays; one it stripped is not invented.
        let kept = "<s>Say: Hello </s>";
        assert_eq!(
            open_final_message(kept, "Hello ").unwrap(),
            "<s>Say: Hello "
        );
        let stripped = "<s>Say: Hello</s>";
        assert_eq!(
            open_final_message(stripped, "Hello ").unwrap(),
            "<s>Say: Hello"
        );
        assert!(open_final_message(closed, "Goodbye").is_err());
        assert!(open_final_message(closed, "  ").is_err());
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new(
            "{{ raise_exception('no system role') }}",
            "".into(),
            "".into(),
        )
        .unwrap();
        let e = t
            .render(&Vec::<ChatMessage>::new(), true, Value::UNDEFINED)
            .unwrap_err();
        assert!(e.to_string().contains("no system role"));
    }
}
