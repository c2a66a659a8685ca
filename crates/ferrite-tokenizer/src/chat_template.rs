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
