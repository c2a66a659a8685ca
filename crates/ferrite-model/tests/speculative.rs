//! Speculative decoding (n-gram drafts, and a draft model's: the test model's first layers,
//! or the test model itself) verified in the packed step, through the engine on the real
//! model (CPU backend): greedy output is the same token for token with speculation on and
//! off, at concurrency 1 and 16, with stop strings and `max_tokens` inside a draft window;
//! sampled output keeps its distribution (chi-square against speculation off).

mod common;

use common::*;
use ferrite_core::engine::EngineHandle;
use ferrite_core::sampling::SamplingParams;
use ferrite_core::spec_decode::{Proposer, SpecStats, Speculation};
use ferrite_model::loader::EngineArgs;
use std::collections::HashMap;
use std::sync::Arc;

const COPY: &str =
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, \
    honeydew, kiwi, lemon, mango. Again: apple, banana, cherry,";

fn engine_spec(
    spec: Option<Speculation>,
) -> (EngineHandle, Arc<ferrite_model::tokenizer::ModelTokenizer>) {
    let mut args = EngineArgs::new(model_path());
    args.max_model_len = Some(1024);
    args.max_num_batched_tokens = 256;
    args.kv_cache_memory = Some((512 * 16 * 2 * 30 * 192 * 4) as u64);
    args.speculation = spec;
    engine_with(args)
}

fn ngram(k: usize) -> Option<Speculation> {
    Some(Speculation {
        k,
        proposer: Proposer::Ngram { min_n: 1, max_n: 3 },
        disable_by_batch_size: 64,
    })
}

/// The test model's first `layers` layers, written once per process.
fn cut_model(layers: u32) -> std::path::PathBuf {
    static CUT: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());
    let path = std::env::temp_dir().join(format!(
        "ferrite-draft-{}-{layers}.gguf",
        std::process::id()
    ));
    let mut done = CUT.lock().unwrap();
    if !done.contains(&layers) {
        ferrite_model::weights::cut::first_layers(&model_path(), &path, layers, false).unwrap();
        done.push(layers);
    }
    path
}

fn draft(k: usize, model: std::path::PathBuf) -> Option<Speculation> {
    Some(Speculation {
        k,
        proposer: Proposer::DraftModel { model },
        disable_by_batch_size: 64,
    })
}

/// Every prompt's output (tokens, text, finish reason), all submitted at once.
fn run(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    params: &[SamplingParams],
) -> Vec<(Vec<u32>, String, &'static str)> {
    let streams: Vec<_> = prompts
        .iter()
        .zip(params)
        .map(|(p, params)| engine.add_request(p.clone(), params.clone()).unwrap())
        .collect();
    streams
        .into_iter()
        .map(|s| {
            let outs = collect(s).unwrap();
            let reason = outs.last().unwrap().finish_reason.unwrap().as_str();
            (tokens_of(&outs), text_of(&outs), reason)
        })
        .collect()
}

/// Runs the prompts greedily with each speculation of `specs` and without, one at a time and
/// 16 at once; asserts the outputs are the same; returns each one's draft counts.
fn greedy_is_unchanged(specs: &[Option<Speculation>]) -> Vec<SpecStats> {
    let (off, tok) = engine_spec(None);
    let mut prompts: Vec<Vec<u32>> = vec![tok.encode(COPY, true).unwrap()];
    prompts.extend(PROMPTS.iter().map(|p| tok.encode(p, true).unwrap()));
    let greedy = |max_tokens, stop: &[&str]| SamplingParams {
        max_tokens: Some(max_tokens),
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ..SamplingParams::greedy()
    };
    // Caps that end inside a window, stop strings met inside accepted drafts, plain runs.
    let mut params: Vec<SamplingParams> = (0..prompts.len())
        .map(|i| greedy(23 + 7 * i as i64, &[]))
        .collect();
    params[0] = greedy(60, &[" kiwi"]);
    params[2] = greedy(40, &["blue", "green"]);
    let one_by_one = |engine: &EngineHandle| -> Vec<_> {
        let pairs = prompts.iter().zip(&params);
        pairs
            .map(|(p, params)| {
                run(
                    engine,
                    std::slice::from_ref(p),
                    std::slice::from_ref(params),
                )
            })
            .collect()
    };
    let many: Vec<Vec<u32>> = prompts.iter().cycle().take(16).cloned().collect();
    let many_params: Vec<SamplingParams> = params.iter().cycle().take(16).cloned().collect();
    let want = (one_by_one(&off), run(&off, &many, &many_params));
    specs
        .iter()
        .map(|spec| {
            let (on, _) = engine_spec(spec.clone());
            // Concurrency 1: one request at a time; then 16: the prompts twice over at once.
            assert_eq!(one_by_one(&on), want.0, "concurrency 1, {spec:?}");
            assert_eq!(
                run(&on, &many, &many_params),
                want.1,
                "concurrency 16, {spec:?}"
            );
            // The stop string was met (inside an accepted draft, with speculation on).
            let a = &want.0[0][0];
            assert!(
                a.2 == "stop" && !a.1.contains("kiwi") && a.0.len() < 60,
                "{a:?}"
            );
            let s = on.stats();
            println!("{spec:?}: {:?}", s.spec);
            idle_stats(&on);
            s.spec
        })
        .collect()
}

#[test]
fn greedy_output_is_the_same_with_speculation_on_and_off() {
    // Drafts were made, and many held (the copy prompt's most of all).
    let s = &greedy_is_unchanged(&[ngram(4)])[0];
    assert!(s.num_drafts > 20, "{s:?}");
    assert!(s.num_accepted_tokens > 100, "{s:?}");
}

#[test]
fn greedy_output_is_the_same_with_a_draft_model() {
    // The first 2 of 30 layers: drafts that mostly fail; the target as its own draft: its
    // greedy drafts are its own tokens, so nearly all hold (not all: a row's rounding
    // differs between a prefill chunk and a decode).
    let stats = greedy_is_unchanged(&[draft(3, cut_model(2)), draft(2, model_path())]);
    let s = &stats[0];
    assert!(s.num_drafts > 50, "{s:?}");
    assert!(s.num_accepted_tokens > 0, "{s:?}");
    assert!(s.num_accepted_tokens < s.num_draft_tokens, "{s:?}");
    let s = &stats[1];
    let rate = s.num_accepted_tokens as f64 / s.num_draft_tokens as f64;
    assert!(s.num_drafts > 50 && rate > 0.9, "{rate}: {s:?}");
}

/// Critical value of chi-square with `df` degrees of freedom at p = 0.001 (Wilson-Hilferty).
fn chi2_critical(df: usize) -> f64 {
    let (k, z) = (df as f64, 3.090_232);
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// Two-sample chi-square statistic over the union of the keys, bins under 5 expected merged.
fn chi2(a: &HashMap<Vec<u32>, usize>, b: &HashMap<Vec<u32>, usize>) -> (f64, usize) {
    let (na, nb) = (
        a.values().sum::<usize>() as f64,
        b.values().sum::<usize>() as f64,
    );
    let mut keys: Vec<&Vec<u32>> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let (mut stat, mut bins) = (0.0, 0);
    let (mut ra, mut rb) = (0.0, 0.0);
    let add = |x: f64, y: f64, stat: &mut f64, bins: &mut usize| {
        let t = x + y;
        *stat += (x * (nb / na).sqrt() - y * (na / nb).sqrt()).powi(2) / t;
        *bins += 1;
    };
    for k in keys {
        let (x, y) = (
            *a.get(k).unwrap_or(&0) as f64,
            *b.get(k).unwrap_or(&0) as f64,
        );
        if x + y < 10.0 {
            ra += x;
            rb += y;
        } else {
            add(x, y, &mut stat, &mut bins);
        }
    }
    if ra + rb > 0.0 {
        add(ra, rb, &mut stat, &mut bins);
    }
    (stat, bins.saturating_sub(1))
}

#[test]
fn sampled_output_keeps_its_distribution_with_speculation() {
    sampled_distribution_is_unchanged(ngram(3), &["temperature", "top-k", "top-p"]);
}

/// Verification does not depend on where drafts come from: one distribution suffices for
/// the draft model's (n-gram's test covers the three).
#[test]
fn sampled_output_keeps_its_distribution_with_a_draft_model() {
    sampled_distribution_is_unchanged(draft(3, cut_model(2)), &["top-p"]);
}

fn sampled_distribution_is_unchanged(spec: Option<Speculation>, which: &[&str]) {
    let (off, tok) = engine_spec(None);
    let (on, _) = engine_spec(spec);
    let prompt = tok.encode(COPY, true).unwrap();
    let n = 800;
    for (name, base) in [
        (
            "temperature",
            SamplingParams {
                temperature: 1.0,
                ..SamplingParams::default()
            },
        ),
        (
            "top-k",
            SamplingParams {
                temperature: 1.0,
                top_k: 5,
                ..SamplingParams::default()
            },
        ),
        (
            "top-p",
            SamplingParams {
                temperature: 1.5,
                top_p: 0.9,
                ..SamplingParams::default()
            },
        ),
    ]
    .into_iter()
    .filter(|(name, _)| which.contains(name))
    {
        // The second token of each sample: it is a verified draft or its replacement (the
        // first comes from the prompt's step), so acceptance and replacement both shape it.
        let params: Vec<SamplingParams> = (0..n)
            .map(|i| SamplingParams {
                seed: Some(1000 + i as u64),
                max_tokens: Some(3),
                ignore_eos: true,
                ..base.clone()
            })
            .collect();
        let prompts = vec![prompt.clone(); n];
        let count = |engine: &EngineHandle| {
            let mut h: HashMap<Vec<u32>, usize> = HashMap::new();
            for chunk in prompts.chunks(16).zip(params.chunks(16)) {
                for (t, _, _) in run(engine, chunk.0, chunk.1) {
                    *h.entry(vec![t[1]]).or_default() += 1;
                }
            }
            h
        };
        let drafts_before = on.stats().spec.num_drafts;
        let (a, b) = (count(&off), count(&on));
        let drafts = on.stats().spec.num_drafts - drafts_before;
        let (stat, df) = chi2(&a, &b);
        println!(
            "{name}: {} / {} distinct outputs, chi2 {stat:.1} with {df} df (critical {:.1}), {drafts} drafts",
            a.len(),
            b.len(),
            chi2_critical(df.max(1))
        );
        assert!(
            drafts as usize > n / 3,
            "{name}: speculation drafted {drafts} times"
        );
        assert!(df >= 2, "{name}: too few outcomes to compare");
        assert!(stat < chi2_critical(df), "{name}: chi2 {stat} with {df} df");
    }
}
