//! The agent dataset generator on the real tokenizer: deterministic per seed, lengths in range
//! with the requested mean.

use ferrite_bench::dataset::{agent, random, AgentShape, Sizer};
use ferrite_model::weights::gguf::GgufFile;
use ferrite_tokenizer::tokenizer::ModelTokenizer;
use std::path::PathBuf;
use std::process::Command;

fn sizer() -> Sizer {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("bash")
        .arg(root.join("scripts/fetch-model.sh"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    Sizer::new(ModelTokenizer::load(&GgufFile::open(&path).unwrap()).unwrap()).unwrap()
}

#[test]
fn mini_preset_lengths_and_determinism() {
    let s = sizer();
    let shape = AgentShape::preset("mini").unwrap();
    for seed in [0, 1, 7] {
        let a = agent(&s, &shape, seed).unwrap();
        assert_eq!(a.len(), 32);
        let mean = a.iter().map(|p| p.input_tokens).sum::<usize>() as f64 / a.len() as f64;
        assert!((mean - 1000.0).abs() <= 100.0, "seed {seed}: mean {mean}");
        for p in &a {
            // Measured independently: re-render and re-tokenize.
            let n = s
                .tokenizer
                .encode(&s.render(&p.messages).unwrap(), false)
                .unwrap()
                .len();
            assert_eq!(n, p.input_tokens);
            assert!((400..=2000).contains(&n), "seed {seed}: {n} tokens");
            assert_eq!(p.max_tokens, 32);
            assert_eq!(p.messages[0]["role"], "system");
            assert!(p.messages[0]["content"]
                .as_str()
                .unwrap()
                .contains("run_shell"));
        }
        let roles: std::collections::HashSet<&str> = a
            .iter()
            .flat_map(|p| p.messages.iter().map(|m| m["role"].as_str().unwrap()))
            .collect();
        assert!(roles.contains("tool") && roles.contains("assistant"));
        let again = agent(&s, &shape, seed).unwrap();
        assert!(a.iter().zip(&again).all(|(x, y)| x.messages == y.messages));
    }
    let other = agent(&s, &shape, 99).unwrap();
    assert_ne!(agent(&s, &shape, 0).unwrap()[0].messages, other[0].messages);
}

#[test]
fn custom_shape_and_random_dataset() {
    let s = sizer();
    let shape = AgentShape {
        num_prompts: 12,
        input_mean: 3000,
        input_min: 1500,
        input_max: 6000,
        output_tokens: 70,
    };
    let a = agent(&s, &shape, 3).unwrap();
    let mean = a.iter().map(|p| p.input_tokens).sum::<usize>() as f64 / 12.0;
    assert!((mean - 3000.0).abs() <= 300.0, "mean {mean}");
    assert!(a.iter().all(|p| (1500..=6000).contains(&p.input_tokens)));
    let r = random(&s, 5, 128, 16, 0).unwrap();
    assert!(r
        .iter()
        .all(|p| p.input_tokens == 128 && p.max_tokens == 16));
}

#[test]
fn sharegpt_file_and_session_replay() {
    let s = sizer();
    let path = std::env::temp_dir().join(format!("sharegpt-{}.json", std::process::id()));
    let data = serde_json::json!([
        {"conversations": [{"from": "human", "value": "What is Rust?"}, {"from": "gpt", "value": "A language."}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"conversations": [{"from": "human", "value": "Name three rivers."}]}
    ]);
    std::fs::write(&path, data.to_string()).unwrap();
    let p = ferrite_bench::dataset::sharegpt(&s, path.to_str().unwrap(), 10, 20).unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!(p[1].messages[0]["content"], "Name three rivers.");
    assert!(p.iter().all(|x| x.input_tokens > 3 && x.max_tokens == 20));
    std::fs::remove_file(path).unwrap();
    // Each turn of a session extends the previous one.
    let turns = ferrite_bench::dataset::session(&s, 5, 16, 1).unwrap();
    for w in turns.windows(2) {
        assert!(w[1].input_tokens > w[0].input_tokens);
        assert_eq!(&w[1].messages[..w[0].messages.len()], &w[0].messages[..]);
    }
}
