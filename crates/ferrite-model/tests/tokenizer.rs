//! The tokenizer built from GGUF metadata against transformers' token ids (fixture), the
//! incremental detokenizer on multi-byte text, and load errors.

mod common;

use candle_core::quantized::gguf_file;
use common::*;
use ferrite_core::detokenizer::IncrementalDetokenizer;
use ferrite_model::loader::{load, EngineArgs};
use ferrite_model::tokenizer::ModelTokenizer;
use ferrite_model::weights::gguf::GgufFile;

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
fn gemma3_token_ids_match_transformers() {
    let g = GgufFile::open(&fetch_model("gemma3")).unwrap();
    let tok = ModelTokenizer::load(&g).unwrap();
    let fx = fixture_of("gemma3");
    let cases = fx["tokenizer"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["token_ids"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "text: {text:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), text);
    }
    // Raw prompts get BOS; turns end with <end_of_turn> as well as <eos>.
    assert_eq!(tok.encode("Hi", true).unwrap()[0], 2);
    let eot = tok.tokenizer.token_to_id("<end_of_turn>").unwrap();
    assert_eq!(tok.eos_token_ids, vec![1, eot]);
    // The GGUF carries no template: Gemma's own turn format is used.
    let t = tok.chat_template.as_deref().unwrap();
    assert!(t.contains("<start_of_turn>"), "{t}");
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

/// A small SentencePiece-style vocabulary (scores, byte fallback, no merges) written as GGUF.
#[test]
fn sentencepiece_vocabulary_from_gguf_metadata() {
    use gguf_file::Value as V;
    let mut tokens: Vec<String> = [
        "<unk>", "<s>", "</s>", "▁", "h", "e", "l", "o", "w", "r", "d",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let merged = [
        "he", "ll", "llo", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world",
    ];
    tokens.extend(merged.iter().map(|s| s.to_string()));
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    // Longer merged pieces score higher, as SentencePiece BPE vocabularies do.
    let scores: Vec<V> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            V::F32(if i < 11 {
                -100.0
            } else {
                t.chars().count() as f32 - 10.0
            })
        })
        .collect();
    let types: Vec<V> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            V::I32(match i {
                0 => 2,
                1 | 2 => 3,
                _ if t.starts_with("<0x") => 6,
                _ => 1,
            })
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("ferrite-spm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("spm.gguf");
    let meta = [
        ("general.architecture", V::String("llama".into())),
        ("tokenizer.ggml.model", V::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            V::Array(tokens.iter().map(|t| V::String(t.clone())).collect()),
        ),
        ("tokenizer.ggml.scores", V::Array(scores)),
        ("tokenizer.ggml.token_type", V::Array(types)),
        ("tokenizer.ggml.bos_token_id", V::U32(1)),
        ("tokenizer.ggml.eos_token_id", V::U32(2)),
        ("tokenizer.ggml.unknown_token_id", V::U32(0)),
    ];
    let refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &refs, &[]).unwrap();

    let tok = ModelTokenizer::load(&GgufFile::open(&path).unwrap()).unwrap();
    let id = |s: &str| tokens.iter().position(|t| t == s).unwrap() as u32;
    assert!(tok.add_bos, "SentencePiece vocabularies add BOS by default");
    assert_eq!(
        tok.encode("hello world", true).unwrap(),
        vec![1, id("▁hello"), id("▁world")]
    );
    // Characters outside the vocabulary fall back to their UTF-8 bytes, and decode back.
    let ids = tok.encode("hé", false).unwrap();
    assert_eq!(ids, vec![id("▁"), id("h"), id("<0xC3>"), id("<0xA9>")]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "hé");
    assert_eq!(
        tok.decode(&tok.encode("hello world", true).unwrap(), true)
            .unwrap(),
        "hello world"
    );

    // A tokenizer.json beside the weights takes precedence over the GGUF metadata.
    tok.tokenizer
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let from_json = ModelTokenizer::load(&GgufFile::open(&path).unwrap()).unwrap();
    assert!(!from_json.add_bos);
    assert_eq!(
        from_json.encode("hello world", false).unwrap(),
        vec![id("▁hello"), id("▁world")]
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A Hugging Face folder without tokenizer.json (`--load-format dummy`): placeholder words,
/// EOS ids from config.json and generation_config.json, the default chat template.
#[test]
fn hf_folder_ids_template_and_placeholder_vocabulary() {
    let dir = std::env::temp_dir().join(format!("ferrite-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
    write(
        "config.json",
        r#"{"model_type": "llama", "bos_token_id": 1, "eos_token_id": [2, 7]}"#,
    );
    write("generation_config.json", r#"{"eos_token_id": 9}"#);
    write(
        "tokenizer_config.json",
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages }}"}]}"#,
    );
    let t = ModelTokenizer::for_config(&dir.join("config.json"), 12).unwrap();
    assert_eq!(t.bos_token_id, Some(1));
    assert_eq!(t.eos_token_ids, vec![2, 7, 9]);
    assert_eq!(t.chat_template.as_deref(), Some("{{ messages }}"));
    assert_eq!(t.encode("<3> <11>", false).unwrap(), vec![3, 11]);
    assert_eq!(t.decode(&[4, 5], false).unwrap(), "<4> <5>");
    std::fs::remove_dir_all(dir).unwrap();
}
