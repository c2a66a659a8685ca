//! Gemma 3 270M through the whole engine: its local layers' KV group drops the blocks that
//! fall out of the 512-token window while a request runs, and no answer changes.

mod common;

use common::*;
use ferrite_core::sampling::SamplingParams;
use ferrite_model::loader::EngineArgs;
use ferrite_model::loader::WeightFormat;
use ferrite_model::sampler::argmax;

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(n as i64),
        ignore_eos: true,
        ..Default::default()
    }
}

/// ~1,000 prompt tokens: twice the window, so the local groups drop blocks during prefill
/// (chunks of 128) and decode.
fn long_prompt(tok: &ferrite_model::tokenizer::ModelTokenizer) -> Vec<u32> {
    let fx = fixture_of("gemma3");
    let text: String = fx["teacher_forced"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["text"].as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n\n");
    let ids = tok
        .encode(&format!("{text}\n\n{text}\n\n{text}"), true)
        .unwrap();
    assert!(ids.len() > 1000, "{}", ids.len());
    ids
}

#[test]
fn window_groups_drop_blocks_and_greedy_output_equals_one_whole_prefill() {
    let mut args = EngineArgs::new(fetch_model("gemma3"));
    args.max_model_len = Some(2048);
    args.max_num_batched_tokens = 128;
    // ~600 blocks of 3 layers: a 1,050-token request holds 66 + 5 x 41.
    args.kv_cache_memory = Some(600 * 16 * 2 * 3 * 256 * 2);
    let (engine, tok) = engine_with(args);
    let prompt = long_prompt(&tok);
    let n = 12;
    let streams: Vec<_> = (0..3)
        .map(|_| engine.add_request(prompt.clone(), greedy(n)).unwrap())
        .collect();
    let outs: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| tokens_of(&collect(s).unwrap()))
        .collect();
    assert!(outs.iter().all(|o| o == &outs[0]), "{outs:?}");
    assert_eq!(outs[0].len(), n);
    // The reference keeps every block of every layer: one prefill of prompt + output.
    let mut model = load_path(&fetch_model("gemma3"), WeightFormat::Auto);
    let mut seq = prompt.clone();
    seq.extend(&outs[0]);
    let logits = all_logits(&mut model, &seq);
    let want: Vec<u32> = (0..n)
        .map(|i| argmax(&logits[prompt.len() - 1 + i]))
        .collect();
    assert_eq!(outs[0], want);
}
