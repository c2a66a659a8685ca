//! Closed-loop load: exactly C requests in flight until every prompt has been sent.

use crate::client::Target;
use crate::dataset::BenchPrompt;
use crate::stats::{level_result, LevelResult, RequestRecord};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub async fn run_level(
    target: &Target,
    prompts: &[BenchPrompt],
    concurrency: usize,
    warmup: usize,
    seed: u64,
) -> LevelResult {
    for p in prompts.iter().cycle().take(warmup) {
        target.send(p, seed).await;
    }
    let bar = ProgressBar::new(prompts.len() as u64).with_style(
        ProgressStyle::with_template("C={msg:>3} [{bar:30}] {pos}/{len} requests, {elapsed}")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_message(concurrency.to_string());
    let next = Arc::new(AtomicUsize::new(0));
    let records = Arc::new(Mutex::new(Vec::<RequestRecord>::new()));
    let prompts: Arc<Vec<BenchPrompt>> = Arc::new(prompts.to_vec());
    let t0 = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (target, next, records, prompts, bar) = (
                target.clone(),
                next.clone(),
                records.clone(),
                prompts.clone(),
                bar.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(p) = prompts.get(i) else { break };
                    let r = target.send(p, seed.wrapping_add(i as u64)).await;
                    records.lock().unwrap().push(r);
                    bar.inc(1);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let duration = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let records = records.lock().unwrap();
    level_result(concurrency, &records, duration)
}
