//! Results: a terminal table, a JSON file, and SVG charts against concurrency with one line
//! per engine.

use crate::stats::LevelResult;
use anyhow::Result;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::fmt::Write;
use std::path::Path;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunReport {
    pub label: String,
    pub base_url: String,
    pub dataset: String,
    pub num_prompts: usize,
    pub mean_input_tokens: f64,
    pub max_tokens: usize,
    pub levels: Vec<LevelJson>,
}

/// [`LevelResult`] flattened for JSON readers (and for reading back to plot).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LevelJson {
    pub concurrency: usize,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub mean_ttft_s: f64,
    pub p50_ttft_s: f64,
    pub p99_ttft_s: f64,
    pub mean_itl_s: f64,
    pub p50_itl_s: f64,
    pub p99_itl_s: f64,
    pub mean_tpot_s: f64,
    pub p50_tpot_s: f64,
    pub p99_tpot_s: f64,
    pub mean_e2e_s: f64,
    pub p50_e2e_s: f64,
    pub p99_e2e_s: f64,
    pub errors: Vec<String>,
    /// Per request, in completion order: (input tokens, TTFT s).
    #[serde(default)]
    pub requests: Vec<(usize, f64)>,
}

impl From<&LevelResult> for LevelJson {
    fn from(l: &LevelResult) -> Self {
        Self {
            concurrency: l.concurrency,
            completed: l.completed,
            failed: l.failed,
            duration_s: l.duration_s,
            total_input_tokens: l.total_input_tokens,
            total_output_tokens: l.total_output_tokens,
            request_throughput: l.request_throughput,
            output_throughput: l.output_throughput,
            mean_ttft_s: l.ttft_s.mean,
            p50_ttft_s: l.ttft_s.p50,
            p99_ttft_s: l.ttft_s.p99,
            mean_itl_s: l.itl_s.mean,
            p50_itl_s: l.itl_s.p50,
            p99_itl_s: l.itl_s.p99,
            mean_tpot_s: l.tpot_s.mean,
            p50_tpot_s: l.tpot_s.p50,
            p99_tpot_s: l.tpot_s.p99,
            mean_e2e_s: l.e2e_s.mean,
            p50_e2e_s: l.e2e_s.p50,
            p99_e2e_s: l.e2e_s.p99,
            errors: l.errors.clone(),
            requests: l.requests.clone(),
        }
    }
}

pub fn table(r: &RunReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "| C | done | failed | wall s | req/s | out tok/s | TTFT mean / p50 / p99 s | ITL mean / p50 / p99 ms | TPOT mean ms | E2E mean s |");
    let _ = writeln!(
        s,
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for l in &r.levels {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} | {:.2} | {:.1} | {:.2} / {:.2} / {:.2} | {:.0} / {:.0} / {:.0} | {:.0} | {:.2} |",
            l.concurrency, l.completed, l.failed, l.duration_s, l.request_throughput, l.output_throughput,
            l.mean_ttft_s, l.p50_ttft_s, l.p99_ttft_s, l.mean_itl_s * 1e3, l.p50_itl_s * 1e3, l.p99_itl_s * 1e3,
            l.mean_tpot_s * 1e3, l.mean_e2e_s
        );
    }
    s
}

const COLORS: [RGBColor; 5] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
];

/// Writes `ttft.svg`, `throughput.svg` and `itl.svg` into `dir`.
pub fn charts(reports: &[RunReport], dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    type Metric = fn(&LevelJson) -> f64;
    let metrics: [(&str, &str, Metric); 3] = [
        ("ttft.svg", "mean TTFT (s)", |l| l.mean_ttft_s),
        ("throughput.svg", "output tokens/s", |l| l.output_throughput),
        ("itl.svg", "mean ITL (ms)", |l| l.mean_itl_s * 1e3),
    ];
    for (file, ylabel, f) in metrics {
        let path = dir.join(file);
        let root = SVGBackend::new(&path, (640, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let max_c = reports
            .iter()
            .flat_map(|r| r.levels.iter().map(|l| l.concurrency))
            .max()
            .unwrap_or(1) as f64;
        let max_y = reports
            .iter()
            .flat_map(|r| r.levels.iter().map(f))
            .fold(0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .caption(ylabel, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d((0.5f64..max_c * 1.4).log_scale(), 0f64..max_y)?;
        chart
            .configure_mesh()
            .x_desc("concurrency")
            .y_desc(ylabel)
            .draw()?;
        for (i, r) in reports.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = r
                .levels
                .iter()
                .map(|l| (l.concurrency as f64, f(l)))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                .label(r.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(())
}
