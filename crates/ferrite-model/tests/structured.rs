//! Structured output through the engine on the real model (CPU backend): a grammar's mask
//! applied to every sampled row keeps the output inside the language, with sampling on,
//! while unconstrained requests share the steps; several constrained requests at once.

mod common;

use common::*;
use ferrite_core::sampling::SamplingParams;
use ferrite_grammar::{Grammars, Spec};
use serde_json::json;

#[test]
fn constrained_requests_follow_their_grammar_beside_free_ones() {
    let (engine, tok) = engine(256, 64);
    let vocab = tok.tokenizer.get_vocab_size(true);
    let grammars = Grammars::new(&tok.tokenizer, vocab, &tok.eos_token_ids).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    });
    let prompt = tok.encode("A person, as JSON:", true).unwrap();
    let specs = [
        Spec::JsonSchema(schema.clone()),
        Spec::Regex("[0-9]{2}:[0-9]{2}".into()),
        Spec::Choice(vec!["left".into(), "right".into()]),
    ];
    let params = |seed| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: Some(120),
        ..SamplingParams::default()
    };
    // Three seeds of each grammar, and free requests in the same steps.
    let mut streams = Vec::new();
    for (k, spec) in specs.iter().enumerate() {
        for seed in 0..3 {
            let g = grammars.compile(spec).unwrap().into_constraint();
            let s = engine.add_constrained(prompt.clone(), params(seed), Some(g));
            streams.push((k, s.unwrap()));
        }
    }
    let free: Vec<_> = (0..3)
        .map(|seed| engine.add_request(prompt.clone(), params(seed)).unwrap())
        .collect();
    for (k, s) in streams {
        let outs = collect(s).unwrap();
        let text = tok.decode(&tokens_of(&outs), true).unwrap();
        let reason = outs.last().unwrap().finish_reason.unwrap();
        println!("{:?}: {text:?} ({})", specs[k], reason.as_str());
        assert_eq!(reason.as_str(), "stop", "{text:?}");
        match k {
            0 => {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                let age = v["age"].as_i64().unwrap();
                assert!((0..=120).contains(&age), "{text}");
                assert!(v["name"].as_str().unwrap().chars().count() <= 12, "{text}");
                assert!(v["tags"].as_array().unwrap().len() <= 3, "{text}");
            }
            1 => {
                let b = text.as_bytes();
                assert!(text.len() == 5 && b[2] == b':', "{text}");
                assert!(
                    text.chars().filter(|c| c.is_ascii_digit()).count() == 4,
                    "{text}"
                );
            }
            _ => assert!(text == "left" || text == "right", "{text}"),
        }
    }
    // The free requests were not constrained: they run to their token budget.
    for s in free {
        let outs = collect(s).unwrap();
        assert!(!tokens_of(&outs).is_empty());
    }
}

#[test]
fn a_schema_that_does_not_compile_is_an_error_naming_it() {
    let tok = ferrite_model::checkpoint::open_tokenizer(&model_path()).unwrap();
    let vocab = tok.tokenizer.get_vocab_size(true);
    let grammars = Grammars::new(&tok.tokenizer, vocab, &tok.eos_token_ids).unwrap();
    let err = grammars
        .compile(&Spec::JsonSchema(json!({"type": "wizard"})))
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("wizard"), "{err:#}");
    assert!(grammars.compile(&Spec::Regex("(open".into())).is_err());
}

/// With a reasoning parser, the grammar waits for the reasoning block (vLLM's order): every
/// token allowed inside `<think>...</think>`, the grammar's mask after it; a block the prompt
/// already closed, or (Qwen3) an output that does not open one, is constrained from the start.
#[test]
fn the_grammar_starts_after_the_reasoning_block() {
    use ferrite_core::constraint::{is_allowed, TokenConstraint};
    use ferrite_grammar::Reasoning;
    let mut tok = ferrite_model::checkpoint::open_tokenizer(&model_path()).unwrap();
    let added = [
        tokenizers::AddedToken::from("<think>", true),
        tokenizers::AddedToken::from("</think>", true),
    ];
    tok.tokenizer.add_special_tokens(added).unwrap();
    let id = |t: &str| tok.tokenizer.token_to_id(t).unwrap();
    let (open, close, word) = (id("<think>"), id("</think>"), id("hello"));
    let vocab = tok.tokenizer.get_vocab_size(true);
    let grammars = Grammars::new(&tok.tokenizer, vocab, &tok.eos_token_ids).unwrap();
    let brace = tok.tokenizer.encode("{", false).unwrap().get_ids()[0];
    let json = || grammars.compile(&Spec::JsonObject).unwrap();
    let free = |m: &[u32]| {
        [word, brace, close]
            .iter()
            .all(|&t| is_allowed(m, t as usize))
    };
    let constrained = |m: &[u32]| is_allowed(m, brace as usize) && !is_allowed(m, word as usize);

    let mut g = json().after_reasoning(Reasoning::Opened, false);
    assert!(free(&g.allowed()));
    for t in [word, word, close] {
        g.commit(t);
    }
    assert!(constrained(&g.allowed()), "after </think>");
    let mut g = json().after_reasoning(Reasoning::Opened, true);
    assert!(constrained(&g.allowed()), "closed in the prompt");

    let mut g = json().after_reasoning(Reasoning::Optional, false);
    let first = g.allowed();
    assert!(is_allowed(&first, open as usize) && constrained(&first));
    g.commit(open);
    assert!(free(&g.allowed()), "inside an opened block");
    g.commit(close);
    assert!(constrained(&g.allowed()));
    let mut g = json().after_reasoning(Reasoning::Optional, false);
    g.commit(brace);
    let m = g.allowed();
    assert!(
        !is_allowed(&m, open as usize) && !is_allowed(&m, word as usize),
        "no block opened"
    );
}

/// A grammar that panics (a bug, never bad input) fails its own request only; the requests
/// sharing its steps finish as if it were not there.
#[test]
fn a_failing_row_fails_its_request_only() {
    use ferrite_core::constraint::{Constraint, TokenConstraint};
    struct Broken;
    impl TokenConstraint for Broken {
        fn allowed(&mut self) -> Vec<u32> {
            panic!("grammar bug")
        }
        fn commit(&mut self, _: u32) {}
    }
    let (engine, tok) = engine(256, 64);
    let prompt = tok.encode("Once upon a time", true).unwrap();
    let params = SamplingParams {
        max_tokens: Some(8),
        ignore_eos: true,
        ..SamplingParams::greedy()
    };
    let others: Vec<_> = (0..3)
        .map(|_| engine.add_request(prompt.clone(), params.clone()).unwrap())
        .collect();
    let broken = engine.add_constrained(
        prompt.clone(),
        params.clone(),
        Some(Constraint::new(Box::new(Broken))),
    );
    let err = collect(broken.unwrap()).unwrap_err();
    assert!(format!("{err}").contains("grammar bug"), "{err}");
    for s in others {
        assert_eq!(tokens_of(&collect(s).unwrap()).len(), 8);
    }
}
