//! The whole engine on the real model: batch invariance, greedy outputs at concurrency 1 and
//! 8, preemption, seeds, stop strings, logprobs and bad input.

mod common;

use common::*;
use ferrite_core::engine::{EngineError, EngineHandle};
use ferrite_core::request::FinishReason;
use ferrite_core::sampling::SamplingParams;
use ferrite_model::loader::WeightFormat;
use ferrite_model::sampler::{log_sum_exp, top_k_logprobs};
use ferrite_model::step::PackedStep;
use ferrite_model::step::StepModel;

fn greedy(max_tokens: i64) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// Logits of a request computed alone equal its logits inside a packed step with 7 other
/// requests of different lengths (prefill chunks and decodes with cached context).
#[test]
fn logits_do_not_depend_on_the_rest_of_the_batch() {
    let mut model = load_model(WeightFormat::Native);
    let fx = fixture();
    let texts = fx["teacher_forced"].as_array().unwrap();
    let a = ids(&texts[0]["token_ids"])[..61].to_vec();
    let alone = all_logits(&mut model, &a);
    let alone_last = alone.last().unwrap();

    let bs = 16;
    model.allocate_cache(200, bs).unwrap();
    let mut next_block = 0u32;
    let mut blocks = |n: usize| {
        let t: Vec<u32> = (next_block..next_block + n as u32).collect();
        next_block += n as u32;
        t
    };
    // Four requests with context already in the cache, to decode in the mixed step.
    let others: Vec<Vec<u32>> = (1..4)
        .flat_map(|i| {
            let t = ids(&texts[i]["token_ids"]);
            vec![t[..20 + 9 * i].to_vec(), t[5..40 + 3 * i].to_vec()]
        })
        .collect();
    let tables: Vec<Vec<u32>> = others
        .iter()
        .map(|o| blocks((o.len() + 1).div_ceil(bs)))
        .collect();
    let mut warm = PackedStep::default();
    for (o, t) in others.iter().zip(&tables).take(4) {
        warm.push(&o[..o.len() - 1], 0, std::slice::from_ref(t), bs);
    }
    warm.logits_indices = vec![0];
    warm.finish();
    model.forward(&warm).unwrap();

    let a_table = blocks(a.len().div_ceil(bs));
    let mut step = PackedStep::default();
    step.push(
        &others[0][others[0].len() - 1..],
        others[0].len() - 1,
        std::slice::from_ref(&tables[0]),
        bs,
    );
    step.push(&others[4][..17], 0, std::slice::from_ref(&tables[4]), bs);
    step.push(
        &others[1][others[1].len() - 1..],
        others[1].len() - 1,
        std::slice::from_ref(&tables[1]),
        bs,
    );
    step.push(&a, 0, std::slice::from_ref(&a_table), bs);
    let a_last = step.num_tokens() - 1;
    step.push(
        &others[2][others[2].len() - 1..],
        others[2].len() - 1,
        std::slice::from_ref(&tables[2]),
        bs,
    );
    step.push(
        &others[5][..others[5].len() - 1],
        0,
        std::slice::from_ref(&tables[5]),
        bs,
    );
    step.push(
        &others[3][others[3].len() - 1..],
        others[3].len() - 1,
        std::slice::from_ref(&tables[3]),
        bs,
    );
    let extra_table = blocks(3);
    step.push(&others[4][..33], 0, std::slice::from_ref(&extra_table), bs);
    step.logits_indices = vec![0, a_last as u32, step.num_tokens() as u32 - 1];
    step.finish();
    assert_eq!(step.num_seqs(), 8);
    let v = model.config.vocab_size;
    let packed = model.forward(&step).unwrap();
    let packed_a = &packed[v..2 * v];
    let max_diff = alone_last
        .iter()
        .zip(packed_a)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    println!("max |logit difference| alone vs packed with 7 others: {max_diff:e}");
    // Stated tolerance: the same up to f32 reassociation in the GEMM (observed 0).
    assert!(max_diff <= 1e-3, "logits moved by {max_diff}");
}

#[test]
fn greedy_outputs_identical_at_concurrency_1_and_8() {
    // A small step budget forces chunked prefill to share steps with decodes.
    let (engine, tok) = engine(600, 48);
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| tok.encode(p, false).unwrap())
        .collect();
    let sequential: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| tokens_of(&collect(engine.add_request(p.clone(), greedy(24)).unwrap()).unwrap()))
        .collect();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.add_request(p.clone(), greedy(24)).unwrap())
        .collect();
    let concurrent: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| tokens_of(&collect(s).unwrap()))
        .collect();
    for (i, (a, b)) in sequential.iter().zip(&concurrent).enumerate() {
        assert!(!a.is_empty());
        assert_eq!(a, b, "prompt {i} differs at concurrency 8");
    }
    idle_stats(&engine);
}

#[test]
fn a_prompt_longer_than_the_step_budget_gives_the_same_tokens_in_chunks() {
    // A 16-token budget prefills the prompt over several steps that sample no row.
    let (chunked, tok) = engine(600, 16);
    let (whole, _) = engine(600, 512);
    let ids = tok.encode(&PROMPTS.join(" "), false).unwrap();
    assert!(ids.len() > 3 * 16, "prompt of {} tokens", ids.len());
    let run = |e: &EngineHandle| {
        tokens_of(&collect(e.add_request(ids.clone(), greedy(8)).unwrap()).unwrap())
    };
    let a = run(&chunked);
    assert!(!a.is_empty());
    assert_eq!(a, run(&whole));
}

#[test]
fn preempted_requests_produce_the_same_greedy_tokens() {
    let prompts: Vec<&str> = PROMPTS[..6].to_vec();
    let run = |blocks: usize| {
        let (engine, tok) = engine_with_len(blocks, 64, 128);
        let streams: Vec<_> = prompts
            .iter()
            .map(|p| {
                let params = SamplingParams {
                    ignore_eos: true,
                    ..greedy(40)
                };
                engine
                    .add_request(tok.encode(p, false).unwrap(), params)
                    .unwrap()
            })
            .collect();
        let out: Vec<Vec<u32>> = streams
            .into_iter()
            .map(|s| tokens_of(&collect(s).unwrap()))
            .collect();
        (out, engine.stats().num_preemptions)
    };
    // Six requests of ~60 tokens need ~24 blocks; 10 blocks (one max-length request and a
    // little more) hold two or three at a time.
    let (tight, preemptions) = run(10);
    let (roomy, none) = run(600);
    assert!(preemptions > 0, "the tight pool should preempt");
    assert_eq!(none, 0);
    assert_eq!(tight, roomy);
}

#[test]
fn seeded_sampling_is_reproducible_whatever_shares_the_step() {
    let (engine, tok) = engine(600, 64);
    let p = tok.encode(PROMPTS[4], false).unwrap();
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        seed: Some(1234),
        max_tokens: Some(30),
        ignore_eos: true,
        ..Default::default()
    };
    let alone =
        tokens_of(&collect(engine.add_request(p.clone(), params.clone()).unwrap()).unwrap());
    let crowd: Vec<_> = PROMPTS
        .iter()
        .map(|q| {
            let unseeded = SamplingParams {
                seed: None,
                ..params.clone()
            };
            engine
                .add_request(tok.encode(q, false).unwrap(), unseeded)
                .unwrap()
        })
        .collect();
    let again =
        tokens_of(&collect(engine.add_request(p.clone(), params.clone()).unwrap()).unwrap());
    drop(crowd);
    assert_eq!(alone, again);
    let other_seed = SamplingParams {
        seed: Some(99),
        ..params
    };
    let different = tokens_of(&collect(engine.add_request(p, other_seed).unwrap()).unwrap());
    assert_ne!(
        alone, different,
        "a different seed should change a 30-token sample"
    );
}

#[test]
fn stop_strings_are_never_emitted_and_lengths_are_reported() {
    let (engine, tok) = engine(300, 128);
    let p = tok.encode(PROMPTS[6], false).unwrap();
    let full = text_of(&collect(engine.add_request(p.clone(), greedy(30)).unwrap()).unwrap());
    // Stop on a piece of what greedy decoding produces anyway.
    let stop = full
        .trim_start()
        .split(',')
        .nth(1)
        .expect("a comma list")
        .trim()
        .to_string();
    assert!(!stop.is_empty(), "{full}");
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..greedy(30)
    };
    let outs = collect(engine.add_request(p.clone(), params).unwrap()).unwrap();
    let text = text_of(&outs);
    assert_eq!(outs.last().unwrap().finish_reason, Some(FinishReason::Stop));
    assert!(!text.contains(&stop), "stop string leaked: {text:?}");
    assert!(
        full.starts_with(&text),
        "{text:?} is not a prefix of {full:?}"
    );
    let params = SamplingParams {
        stop: vec![stop.clone()],
        include_stop_str_in_output: true,
        ..greedy(30)
    };
    let with = text_of(&collect(engine.add_request(p.clone(), params).unwrap()).unwrap());
    assert!(with.ends_with(&stop) && with.starts_with(&text), "{with:?}");
    let outs = collect(engine.add_request(p, greedy(7)).unwrap()).unwrap();
    let last = outs.last().unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Length));
    assert_eq!(last.num_output_tokens, 7);
}

#[test]
fn logprobs_match_the_model_distribution() {
    let (engine, tok) = engine(300, 512);
    // The format the engine resolves by default.
    let mut model = load_model(WeightFormat::Auto);
    let p = tok.encode(PROMPTS[5], false).unwrap();
    let params = SamplingParams {
        logprobs: Some(3),
        prompt_logprobs: Some(2),
        ..greedy(4)
    };
    let outs = collect(engine.add_request(p.clone(), params).unwrap()).unwrap();
    let prompt_lp = outs[0].prompt_logprobs.clone().expect("prompt logprobs");
    assert_eq!(prompt_lp.len(), p.len());
    assert!(prompt_lp[0].is_none());
    let mut seq = p.clone();
    seq.extend(tokens_of(&outs));
    let reference = all_logits(&mut model, &seq);
    for (i, lp) in prompt_lp.iter().enumerate().skip(1) {
        let lp = lp.as_ref().unwrap();
        let row = &reference[i - 1];
        let lse = log_sum_exp(row);
        assert_eq!(lp.token_id, p[i]);
        assert!((lp.logprob - (row[p[i] as usize] - lse)).abs() < 1e-3);
        assert_eq!(lp.top.len(), 2);
    }
    for (j, o) in outs.iter().enumerate() {
        let lp = &o.logprobs[0];
        let row = &reference[p.len() - 1 + j];
        let lse = log_sum_exp(row);
        let top = top_k_logprobs(row, 3, lse);
        assert_eq!(
            lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            top.iter().map(|t| t.0).collect::<Vec<_>>()
        );
        // Greedy picks the most likely token: rank 1, logprob equal to the top entry.
        assert_eq!(lp.rank, 1);
        assert!((lp.logprob - top[0].1).abs() < 1e-3);
    }
}

#[test]
fn bad_input_gets_clear_errors_and_the_engine_lives_on() {
    let (engine, tok) = engine(100, 128);
    let p = tok.encode("Hello there", false).unwrap();
    let err = |r: Result<_, EngineError>| match r {
        Err(e) => {
            assert!(e.is_client_error(), "{e}");
            e.to_string()
        }
        Ok(_) => panic!("bad input accepted"),
    };
    assert!(err(engine.add_request(vec![], greedy(4))).contains("empty"));
    let long = vec![p[0]; 1100];
    assert!(err(engine.add_request(long, greedy(4))).contains("maximum context length is 1024"));
    assert!(err(engine.add_request(p.clone(), greedy(-5))).contains("max_tokens"));
    let neg_t = SamplingParams {
        temperature: -1.0,
        ..greedy(4)
    };
    assert!(err(engine.add_request(p.clone(), neg_t)).contains("temperature"));
    assert!(err(engine.add_request(vec![999_999], greedy(4))).contains("outside the vocabulary"));
    let outs = collect(engine.add_request(p, greedy(4)).unwrap()).unwrap();
    assert_eq!(outs.last().unwrap().num_output_tokens, 4);
}

#[test]
fn dropping_a_stream_aborts_and_frees_its_blocks() {
    let (engine, tok) = engine(100, 64);
    let p = tok.encode(PROMPTS[4], false).unwrap();
    let params = SamplingParams {
        ignore_eos: true,
        ..greedy(500)
    };
    let mut s = engine.add_request(p.clone(), params).unwrap();
    s.blocking_next().unwrap().unwrap();
    drop(s);
    // The abort lands within a step; then the engine is idle with every block free.
    idle_stats(&engine);
}

#[test]
fn a_budget_too_small_for_one_request_fails_at_start_with_numbers() {
    let mut args = ferrite_model::loader::EngineArgs::new(model_path());
    args.max_model_len = Some(8192);
    args.kv_cache_memory = Some(50 << 20);
    let err = ferrite_model::loader::load(&args, |_, _| {})
        .err()
        .expect("the pool cannot hold one 8192-token request")
        .to_string();
    assert!(
        err.contains("--max-model-len 8192 needs 512 blocks"),
        "{err}"
    );
    assert!(err.contains("lower --max-model-len to at most"), "{err}");
}

/// Greedy tokens and logprobs are identical with and without prefix caching, and for a
/// request served from a cache hit versus a cold miss.
#[test]
fn prefix_cache_hits_change_no_answer() {
    let system =
        "<|im_start|>system\nYou are a coding agent. Tools: read_file(path), run_shell(command), \
                  apply_patch(diff). Call one tool at a time and keep replies short.<|im_end|>\n";
    let asks = [
        "<|im_start|>user\nWhy do the tests in src/lib.rs fail?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nRename parse_header to read_header everywhere.<|im_end|>\n<|im_start|>assistant\n",
    ];
    let params = SamplingParams {
        logprobs: Some(5),
        ignore_eos: true,
        ..greedy(12)
    };
    let run = |engine: &ferrite_core::engine::EngineHandle,
               tok: &ferrite_model::tokenizer::ModelTokenizer| {
        asks.iter()
            .map(|a| {
                let p = tok.encode(&format!("{system}{a}"), false).unwrap();
                collect(engine.add_request(p, params.clone()).unwrap()).unwrap()
            })
            .collect::<Vec<_>>()
    };
    let (cached, tok) = engine_opts(300, 64, 1024, true);
    let cold = run(&cached, &tok);
    let first_hits = cached.stats().prefix_cache_hits;
    // The second ask shares the system prompt with the first: a hit of whole blocks.
    assert!(
        first_hits >= 32,
        "expected a shared-prefix hit, got {first_hits} tokens"
    );
    let warm = run(&cached, &tok);
    let stats = cached.stats();
    assert!(stats.prefix_cache_hits > first_hits);
    let (plain, _) = engine_opts(300, 64, 1024, false);
    let uncached = run(&plain, &tok);
    assert_eq!(plain.stats().prefix_cache_hits, 0);
    for outs in [&warm, &uncached] {
        for (a, b) in cold.iter().zip(outs.iter()) {
            assert_eq!(tokens_of(a), tokens_of(b));
            assert_eq!(
                logprobs_of(a),
                logprobs_of(b),
                "logprobs differ between a cache hit and a cold miss"
            );
        }
    }
}
