//! The tokenizer built from GGUF metadata against transformers' token ids (fixture), the
//! incremental detokenizer on multi-byte text, and load errors.

mod common;

use candle_core::quantized::gguf_file;
use common::*;
use ferrite_core::detokenizer::IncrementalDetokenizer;
use ferrite_model::gguf::GgufFile;
use ferrite_model::loader::{load, EngineArgs};
use ferrite_model::tokenizer::ModelTokenizer;

fn tokenizer() -> ModelTokenizer {
    ModelTokenizer::load(&GgufFile::open(&model_path()).unwrap()).unwrap()
}

#[test]
fn token_ids_match_transformers() {
    let tok = tokenizer();
    let fx = fixture();
    let cases = fx["tokenizer"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["token_ids"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "text: {text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), text);
    }
    assert_eq!(tok.eos_token_ids, vec![2]);
    assert!(!tok.add_bos);
    assert!(tok
        .chat_template
        .as_deref()
        .unwrap()
        .contains("<|im_start|>"));
}

#[test]
fn incremental_detokenization_never_emits_broken_utf8() {
    let tok = tokenizer();
    let text = "Prix: 4,80 € — 日本語のテキスト 🚀🔥 naïve café Zürich ∑∫ done";
    let ids = tok.encode(text, false).unwrap();
    // Several characters need more than one byte-level token.
    assert!(ids.len() > text.chars().count() / 2);
    let prompt = tok.encode("Say:", false).unwrap();
    let mut d = IncrementalDetokenizer::new(&prompt, false);
    let mut out = String::new();
    let mut held = 0;
    for &id in &ids {
        let piece = d.push(&tok.tokenizer, id);
        assert!(
            !piece.contains('\u{FFFD}'),
            "broken UTF-8 emitted: {piece:?}"
        );
        held += piece.is_empty() as usize;
        out += &piece;
    }
    out += &d.flush(&tok.tokenizer);
    assert_eq!(out, text);
    assert!(
        held > 0,
        "some tokens should have been held back mid-character"
    );
}

#[test]
fn unknown_architecture_fails_at_load_with_a_clear_message() {
    let dir = std::env::temp_dir().join(format!("ferrite-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gptj.gguf");
    let mut f = std::fs::File::create(&path).unwrap();
    let arch = gguf_file::Value::String("gptj".into());
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &[]).unwrap();
    drop(f);
    let err = load(&EngineArgs::new(&path), |_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("unsupported model architecture `gptj`") && err.contains("llama"),
        "{err}"
    );
    let err = load(&EngineArgs::new(dir.join("missing.gguf")), |_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("cannot open"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
