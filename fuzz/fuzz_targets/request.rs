//! Any bytes as the body of a chat, completion, Messages or Responses request: parsing,
//! validation into sampling parameters and rendering the chat template (a tool-calling one)
//! return a value or an error; they never panic.
#![no_main]

use ferrite_server::chat::normalize_messages;
use ferrite_server::generation::{check_n, sampling_params};
use ferrite_server::messages::MessagesRequest;
use ferrite_server::protocol::{ChatCompletionRequest, CompletionRequest};
use ferrite_server::responses::ResponsesRequest;
use ferrite_tokenizer::chat_template::ChatTemplate;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| {
        let source = include_str!("../../examples/tool_chat_template_smollm2.jinja");
        ChatTemplate::new(source, "<s>".into(), "</s>".into()).unwrap()
    })
}

const VOCAB: usize = 49152;

fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = serde_json::from_slice::<ChatCompletionRequest>(data) {
        let _ = check_n(r.common.n);
        let _ = sampling_params(&r.common, VOCAB, &encode, r.max_completion_tokens, r.top_logprobs, r.prompt_logprobs);
        if let Ok(messages) = normalize_messages(&r.messages) {
            let extra = minijinja::Value::from_serialize(&r.chat_template_kwargs);
            let _ = template().render(&messages, r.add_generation_prompt.unwrap_or(true), extra);
        }
    }
    if let Ok(r) = serde_json::from_slice::<CompletionRequest>(data) {
        let _ = sampling_params(&r.common, VOCAB, &encode, r.common.max_tokens, r.logprobs, r.prompt_logprobs);
    }
    let _ = serde_json::from_slice::<MessagesRequest>(data);
    let _ = serde_json::from_slice::<ResponsesRequest>(data);
});
