use super::*;
use proptest::prelude::*;
use serde_json::json;

fn calls(parser: ToolParser, text: &str) -> (Option<String>, Vec<(String, Value)>) {
    let (content, calls) = parser.parse(text, &tools());
    let calls = calls
        .into_iter()
        .map(|c| {
            let args = serde_json::from_str(&c.function.arguments)
                .unwrap_or_else(|e| panic!("{:?}: {e}", c.function.arguments));
            (c.function.name, args)
        })
        .collect();
    (content, calls)
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "metric": {"type": "boolean"}, "tags": {"type": "array"}}}}}),
    ]
}

fn weather(city: &str) -> (String, Value) {
    ("get_weather".into(), json!({"city": city}))
}

#[test]
fn hermes_calls_anywhere() {
    let text = "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>";
    assert_eq!(
        calls(ToolParser::Hermes, text),
        (None, vec![weather("Paris"), ("now".into(), json!({}))])
    );
    let (_, whole) = ToolParser::Hermes.parse(text, &[]);
    assert_eq!(whole[0].function.arguments, r#"{"city": "Paris"}"#);
    assert_ne!(whole[0].id, whole[1].id);
    let prose = "Let me check. <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>";
    assert_eq!(
        calls(ToolParser::Hermes, prose),
        (Some("Let me check.".into()), vec![weather("Oslo")])
    );
    // Arguments as a JSON string, as some models write them.
    let s =
        r#"<tool_call>{"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}</tool_call>"#;
    assert_eq!(calls(ToolParser::Hermes, s), (None, vec![weather("Rome")]));
}

#[test]
fn malformed_output_stays_content() {
    for (parser, text) in [
        (ToolParser::Hermes, "<tool_call>{not json</tool_call>"),
        (ToolParser::Hermes, "<tool_call>{\"x\": 1}</tool_call>"),
        (ToolParser::Hermes, "plain"),
        (ToolParser::Hermes, "a < b <tool_c"),
        (ToolParser::Llama3Json, "{\"oops\": 1}"),
        (
            ToolParser::Llama3Json,
            "Sure: {\"name\": \"f\", \"parameters\": {}}",
        ),
        (ToolParser::Mistral, "[TOOL_CALLS] nope"),
        (ToolParser::Pythonic, "[1, 2, 3] are numbers"),
        (ToolParser::Qwen3Coder, "<tool_call>\n<func"),
        (ToolParser::Qwen3Coder, "<tool_call><oops>"),
    ] {
        let (content, calls) = parser.parse(text, &tools());
        assert!(calls.is_empty(), "{parser:?} {text:?}: {calls:?}");
        assert_eq!(content.as_deref(), Some(text), "{parser:?}");
    }
}

#[test]
fn llama3_json_calls() {
    let text = r#"{"name": "search", "parameters": {"q": "rust"}}; {"name": "open", "parameters": {"id": 3}}"#;
    assert_eq!(
        calls(ToolParser::Llama3Json, text),
        (
            None,
            vec![
                ("search".into(), json!({"q": "rust"})),
                ("open".into(), json!({"id": 3}))
            ]
        )
    );
    let tagged = r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}"#;
    assert_eq!(
        calls(ToolParser::Llama3Json, tagged),
        (None, vec![weather("Lima")])
    );
}

#[test]
fn mistral_calls() {
    let text = r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Nice"}}]"#;
    assert_eq!(
        calls(ToolParser::Mistral, text),
        (None, vec![weather("Paris"), weather("Nice")])
    );
    let v11 = r#"Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}"#;
    assert_eq!(
        calls(ToolParser::Mistral, v11),
        (Some("Checking.".into()), vec![weather("Bern")])
    );
}

#[test]
fn pythonic_calls() {
    let text = r#"[get_weather(city="Paris", days=3, metric=True, tags=['a', "b"]), now()]"#;
    assert_eq!(
        calls(ToolParser::Pythonic, text),
        (
            None,
            vec![
                (
                    "get_weather".into(),
                    json!({"city": "Paris", "days": 3, "metric": true, "tags": ["a", "b"]})
                ),
                ("now".into(), json!({}))
            ]
        )
    );
    let gemma = "I'll look.\n```tool_code\nget_weather(city='Oslo')\n```";
    assert_eq!(
        calls(ToolParser::Pythonic, gemma),
        (Some("I'll look.".into()), vec![weather("Oslo")])
    );
}

#[test]
fn qwen3_coder_calls_typed_by_schema() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        calls(ToolParser::Qwen3Coder, text),
        (
            None,
            vec![(
                "get_weather".into(),
                json!({"city": "New York", "days": 5, "metric": false})
            )]
        )
    );
    // A number-looking city stays a string: the schema says string.
    let text =
        "<tool_call><function=get_weather><parameter=city>1984</parameter></function></tool_call>";
    assert_eq!(
        calls(ToolParser::Qwen3Coder, text),
        (None, vec![("get_weather".into(), json!({"city": "1984"}))])
    );
}

#[test]
fn streamed_calls_go_out_name_first_then_arguments() {
    let mut s = CallStream::new(ToolParser::Hermes, &[]);
    let mut events = Vec::new();
    for piece in [
        "<tool",
        "_call>{\"name\": \"get_",
        "weather\", \"arguments\": {\"ci",
        "ty\": \"Paris\"}",
        "}</tool_call>",
    ] {
        events.push(s.push(piece));
    }
    events.push(s.finish());
    assert_eq!(events[0], vec![]);
    assert_eq!(events[1], vec![]);
    assert!(
        matches!(&events[2][..], [ToolEvent::Start { name, .. }, ToolEvent::Args { text, .. }] if name == "get_weather" && text == "{\"ci")
    );
    assert_eq!(
        events[3],
        vec![ToolEvent::Args {
            index: 0,
            text: "ty\": \"Paris\"}".into()
        }]
    );
}

/// Sample outputs of every format, with content, several calls and broken calls.
fn samples() -> Vec<(ToolParser, &'static str)> {
    vec![
        (ToolParser::Hermes, "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris \\\"Centre\\\"\", \"tags\": [\"a\", {\"b\": 1}]}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>"),
        (ToolParser::Hermes, "<tool_call>{\"name\": \"x\", \"argu"),
        (ToolParser::Hermes, "no <tool_call>{bad</tool_call> calls <tool_call>"),
        (ToolParser::Hermes, "  héllo ünïcode <tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"日本\"}}</tool_call> after"),
        (ToolParser::Llama3Json, "  {\"name\": \"a\", \"parameters\": {\"n\": -1.5e3}}; {\"name\": \"b\", \"parameters\": {}}"),
        (ToolParser::Llama3Json, "plain text {\"name\": \"a\"}"),
        (ToolParser::Mistral, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}, {\"name\": \"b\", \"arguments\": {}}]"),
        (ToolParser::Mistral, "x[TOOL_CALLS]a[ARGS]{\"k\": true}[TOOL_CALLS]b[ARGS]{}"),
        (ToolParser::Pythonic, "[a(x=1, y='two'), b(z=[1, (2, 3)], w={'k': None})]"),
        (ToolParser::Pythonic, "text ```tool_code\nf(a=\"q\\\"uote\")\n``` more"),
        (ToolParser::Qwen3Coder, "Plan:\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n</function>\n</tool_call>"),
        (ToolParser::Qwen3Coder, "<tool_call>\n<function=f>\n</function>\n</tool_call><tool_call>\n<function=g>\n<parameter=a>\n1\n</parameter>"),
    ]
}

proptest! {
    /// However the output is cut into deltas, the stream's events fold to the whole parse:
    /// streamed and whole responses carry the same content and the same calls.
    #[test]
    fn any_split_streams_the_whole_parse(cuts in proptest::collection::vec(0usize..400, 0..12)) {
        for (parser, text) in samples() {
            let (whole_content, whole_calls) = parser.parse(text, &tools());
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).filter(|&c| text.is_char_boundary(c)).collect();
            at.sort();
            let mut s = CallStream::new(parser, &tools());
            let mut events = Vec::new();
            let mut prev = 0;
            for c in at.into_iter().chain([text.len()]) {
                events.extend(s.push(&text[prev..c]));
                prev = c;
            }
            events.extend(s.finish());
            let (content, calls) = fold(events);
            prop_assert_eq!(content, whole_content, "{:?} {:?}", parser, text);
            let strip = |c: &[ToolCall]| c.iter().map(|c| (c.function.name.clone(), c.function.arguments.clone())).collect::<Vec<_>>();
            prop_assert_eq!(strip(&calls), strip(&whole_calls), "{:?} {:?}", parser, text);
        }
    }
}
