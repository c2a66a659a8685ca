//! The CPU model's verify step against its decode step: one request at context CTX feeding
//! its last token and k drafts (1 + k rows, every row's logits), k = 0 being a plain decode.
//! The cost model that decides when speculation pays on this host. Each figure is the
//! fastest of REPEATS steps (a shared host's noise only ever adds time).
//! Usage: cargo run --release -p ferrite-model --example verify_speed -- MODEL [CTX] [REPEATS] [ROWS]
//! (ROWS: time that many rows only, e.g. under a profiler)

use ferrite_model::engine_args::{LoadFormat, WeightFormat};
use ferrite_model::loader::load_cpu_decoder;
use ferrite_model::step::PackedStep;
use ferrite_model::step::StepModel;
use std::time::Instant;

fn main() {
    let model = std::env::args()
        .nth(1)
        .expect("usage: verify_speed MODEL [CTX] [REPEATS]");
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |s| s.parse().unwrap());
    let (ctx, repeats, only) = (arg(2, 300), arg(3, 40), arg(4, 0));
    let bs = 16;
    let mut m = load_cpu_decoder(
        model.as_ref(),
        LoadFormat::Auto,
        WeightFormat::Native,
        None,
        Some(ctx + 64),
        &mut |_, _| {},
    )
    .unwrap();
    let blocks = (ctx + 16).div_ceil(bs);
    let groups = m.layout.groups.len();
    m.allocate_cache(blocks * groups, bs).unwrap();
    m.allocate_state(1).unwrap();
    let tables: Vec<Vec<u32>> = (0..groups)
        .map(|g| {
            (0..blocks as u32)
                .map(|b| (g * blocks) as u32 + b)
                .collect()
        })
        .collect();
    let ids = |n: usize, from: usize| -> Vec<u32> {
        (from..from + n)
            .map(|i| (1000 + i * 7919 % 30000) as u32)
            .collect()
    };
    // The context, one prefill step.
    let mut s = PackedStep::default();
    s.push(&ids(ctx, 0), 0, &tables, bs);
    s.state.slots.push(0);
    s.logits_indices.push(ctx as u32 - 1);
    s.finish();
    m.forward_argmax(&s).unwrap();
    println!("| rows (1 + k) | step ms | / decode |");
    println!("|---:|---:|---:|");
    let mut decode = 0.0;
    let counts = if only > 0 { only..=only } else { 1..=5 };
    for rows in counts {
        let mut s = PackedStep::default();
        s.push(&ids(rows, ctx), ctx, &tables, bs);
        s.state.slots.push(0);
        s.logits_indices = (0..rows as u32).collect();
        s.finish();
        m.forward_argmax(&s).unwrap();
        let ms = (0..repeats)
            .map(|_| {
                let t0 = Instant::now();
                m.forward_argmax(&s).unwrap();
                t0.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min);
        if rows == 1 {
            decode = ms;
        }
        println!("| {rows} | {ms:.2} | {:.2} |", ms / decode);
    }
}
