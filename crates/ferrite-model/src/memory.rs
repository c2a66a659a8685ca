//! The memory budget: device memory x utilization, minus weights and the profiled activation
//! peak, gives the KV pool, sized once at start-up.

use crate::kv_dtype::KvCacheDtype;
use anyhow::{bail, Context, Result};
use ferrite_core::kv_layout::{max_blocks, GroupWindow};
use std::fmt;

/// Physical RAM (macOS: `hw.memsize`).
#[cfg(target_os = "macos")]
pub fn physical_memory_bytes() -> Result<u64> {
    let (mut bytes, mut len) = (0u64, std::mem::size_of::<u64>());
    // SAFETY: `bytes` is a u64 and `len` its size, as hw.memsize's value is.
    let r = unsafe {
        libc::sysctlbyname(
            c"hw.memsize".as_ptr(),
            &mut bytes as *mut u64 as *mut libc::c_void,
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    if r != 0 {
        bail!("sysctl hw.memsize: {}", std::io::Error::last_os_error());
    }
    Ok(bytes)
}

/// Physical RAM, or the cgroup limit when that is lower (containers).
#[cfg(not(target_os = "macos"))]
pub fn physical_memory_bytes() -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kb: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("MemTotal missing from /proc/meminfo")?;
    let mut total = kb * 1024;
    if let Ok(limit) = std::fs::read_to_string("/sys/fs/cgroup/memory.max") {
        if let Ok(l) = limit.trim().parse::<u64>() {
            total = total.min(l);
        }
    }
    Ok(total)
}

/// Memory the host can give without swapping (`MemAvailable`): what a GPU sharing the
/// host's memory (DGX Spark's GB10, Jetson) can take.
pub fn available_memory_bytes() -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kb: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("MemAvailable missing from /proc/meminfo")?;
    Ok(kb * 1024)
}

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Resident set size now.
pub fn rss_bytes() -> u64 {
    status_kb("VmRSS:") * 1024
}

/// Peak resident set size since start or the last [`reset_peak_rss`].
pub fn peak_rss_bytes() -> u64 {
    status_kb("VmHWM:") * 1024
}

/// Resets the kernel's peak-RSS mark so a profiling run measures only itself.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The buffers one CPU step of `tokens` tokens allocates (activations, MLP, logits of a
/// row): what is planned where the step cannot be run and measured.
pub fn activation_estimate(c: &crate::config::ModelConfig, tokens: usize) -> u64 {
    let h = c.hidden_size.max(c.num_heads * c.head_dim);
    (tokens * (6 * h + 3 * c.intermediate_size) * 4 + c.vocab_size * 4) as u64
}

/// A draft model's part of the plan (speculation): its weights, and its K/V in each block.
/// Both are already in the plan's weights and bytes per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftShare {
    pub weight_bytes: u64,
    pub bytes_per_block: u64,
}

#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub device_bytes: u64,
    pub utilization: f64,
    pub budget_bytes: u64,
    pub weight_bytes: u64,
    pub activation_bytes: u64,
    pub kv_bytes: u64,
    pub bytes_per_block: u64,
    pub kv_dtype: KvCacheDtype,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_model_len: usize,
    /// Blocks one `max_model_len` request holds at most, over every KV group.
    pub blocks_per_request: usize,
    pub kv_groups: Vec<GroupWindow>,
    /// Layers a block holds (one of every group).
    pub layers_per_block: usize,
    /// True when `--kv-cache-memory` set the pool directly.
    pub explicit_kv: bool,
    /// True when the pool was capped at what `max_num_seqs` full-length requests can use.
    pub capped: bool,
    /// True when the pool was capped at what one layer's storage binding holds (a GPU's).
    pub binding_cap: bool,
    /// The recurrent-state pool beside the KV pool (linear-attention layers): running
    /// requests' slots, prefix-cache checkpoints, and their bytes.
    pub state_slots: usize,
    pub state_checkpoints: usize,
    /// Slots holding the state after each draft token of verify steps (speculation).
    pub state_draft_slots: usize,
    pub state_bytes: u64,
    pub draft: Option<DraftShare>,
}

pub struct PlanInputs {
    pub device_bytes: u64,
    pub utilization: f64,
    pub kv_cache_memory: Option<u64>,
    pub weight_bytes: u64,
    pub activation_bytes: u64,
    pub bytes_per_block: u64,
    /// What the blocks store (named in the plan line).
    pub kv_dtype: KvCacheDtype,
    pub block_size: usize,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    /// The KV groups' windows, the layers a block holds, and the most tokens a step
    /// computes (what a window group holds beyond its window).
    pub kv_groups: Vec<GroupWindow>,
    pub layers_per_block: usize,
    pub chunk: usize,
    /// Recurrent state of one request (0 without linear-attention layers): `max_num_seqs`
    /// slots of it, and `state_checkpoints` more for prefix caching, are reserved before the
    /// KV pool.
    pub state_bytes_per_slot: u64,
    pub state_checkpoints: usize,
    /// With speculation: `k` slots for each request that may draft at once.
    pub state_draft_slots: usize,
    /// A draft model's share, included in `weight_bytes` and `bytes_per_block`.
    pub draft: Option<DraftShare>,
    /// The most blocks one layer's pages may hold (a GPU's largest storage binding).
    pub max_blocks: Option<usize>,
}

pub(crate) const GIB: f64 = (1u64 << 30) as f64;

pub fn plan(i: &PlanInputs) -> Result<MemoryPlan> {
    if !(i.utilization > 0.0 && i.utilization <= 1.0) {
        bail!(
            "--gpu-memory-utilization must be in (0, 1], got {}",
            i.utilization
        );
    }
    let budget = (i.device_bytes as f64 * i.utilization) as u64;
    let stateful = i.state_bytes_per_slot > 0;
    let state_slots = if stateful { i.max_num_seqs } else { 0 };
    let state_checkpoints = if stateful { i.state_checkpoints } else { 0 };
    let state_draft_slots = if stateful { i.state_draft_slots } else { 0 };
    let state_bytes =
        (state_slots + state_checkpoints + state_draft_slots) as u64 * i.state_bytes_per_slot;
    let kv_bytes = match i.kv_cache_memory {
        Some(b) => b,
        None => {
            let used = i.weight_bytes + i.activation_bytes + state_bytes;
            if used >= budget {
                bail!(
                    "the memory budget is {:.2} GiB ({:.0}% of {:.2} GiB) but weights take {:.2} GiB, \
                     activations {:.2} GiB and the recurrent state of {state_slots} requests {:.2} GiB, \
                     leaving nothing for the KV cache; raise --gpu-memory-utilization, lower \
                     --max-num-seqs or set --kv-cache-memory",
                    budget as f64 / GIB,
                    i.utilization * 100.0,
                    i.device_bytes as f64 / GIB,
                    i.weight_bytes as f64 / GIB,
                    i.activation_bytes as f64 / GIB,
                    state_bytes as f64 / GIB
                );
            }
            budget - used
        }
    };
    let mut num_blocks = (kv_bytes / i.bytes_per_block) as usize;
    let need = |len: usize| max_blocks(&i.kv_groups, len, i.block_size, i.chunk);
    let blocks_per_request = need(i.max_model_len);
    let binding_cap = i.max_blocks.filter(|&m| m < num_blocks);
    if let Some(cap) = binding_cap {
        if cap < blocks_per_request {
            bail!(
                "one layer's K/V for a request of --max-model-len {} needs {blocks_per_request} \
                 blocks, past the {cap} one storage binding of this GPU holds: lower \
                 --max-model-len",
                i.max_model_len
            );
        }
        num_blocks = cap;
    }
    if num_blocks < blocks_per_request {
        // The longest request that fits (for a fix to suggest).
        let (mut lo, mut hi) = (0, i.max_model_len);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if need(mid) <= num_blocks {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let need = blocks_per_request as u64 * i.bytes_per_block;
        bail!(
            "the KV cache holds {} tokens ({num_blocks} blocks of {}, {:.1} MiB) but one request \
             of --max-model-len {} needs {} blocks ({:.1} MiB); lower --max-model-len to at most \
             {}, or give the cache at least {need} bytes (--kv-cache-memory {need}, or a higher \
             --gpu-memory-utilization)",
            num_blocks * i.block_size,
            i.block_size,
            kv_bytes as f64 / (1 << 20) as f64,
            i.max_model_len,
            blocks_per_request,
            need as f64 / (1 << 20) as f64,
            lo,
        );
    }
    // More blocks than max_num_seqs full-length requests can ever hold would sit unused.
    let useful = blocks_per_request * i.max_num_seqs;
    let capped = i.kv_cache_memory.is_none() && num_blocks > useful;
    if capped {
        num_blocks = useful;
    }
    Ok(MemoryPlan {
        device_bytes: i.device_bytes,
        utilization: i.utilization,
        budget_bytes: budget,
        weight_bytes: i.weight_bytes,
        activation_bytes: i.activation_bytes,
        kv_bytes: num_blocks as u64 * i.bytes_per_block,
        bytes_per_block: i.bytes_per_block,
        kv_dtype: i.kv_dtype,
        block_size: i.block_size,
        num_blocks,
        max_model_len: i.max_model_len,
        blocks_per_request,
        kv_groups: i.kv_groups.clone(),
        layers_per_block: i.layers_per_block,
        explicit_kv: i.kv_cache_memory.is_some(),
        capped,
        binding_cap: binding_cap.is_some(),
        state_slots,
        state_checkpoints,
        state_draft_slots,
        state_bytes,
        draft: i.draft,
    })
}

impl MemoryPlan {
    pub fn kv_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }

    pub fn max_concurrency(&self) -> f64 {
        self.num_blocks as f64 / self.blocks_per_request as f64
    }

    /// The KV groups, when some attend within a window: "1 global + 5 sliding-window (512)
    /// groups of 3 layers".
    fn groups_text(&self) -> Option<String> {
        let windows: Vec<usize> = self.kv_groups.iter().flatten().copied().collect();
        if windows.is_empty() {
            return None;
        }
        let global = self.kv_groups.len() - windows.len();
        let mut w = windows.clone();
        w.dedup();
        let w: Vec<String> = w.iter().map(usize::to_string).collect();
        Some(format!(
            "{global} global + {} sliding-window ({}) groups of {} layers",
            windows.len(),
            w.join(", "),
            self.layers_per_block
        ))
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KV cache: {} blocks x {} tokens{} ({}, {:.2} GiB); max concurrency at \
             max_model_len {}: {:.2}x; budget {:.2} GiB = {:.2} x {:.2} GiB, weights {:.2} GiB, \
             activations {:.3} GiB{}",
            self.num_blocks,
            self.block_size,
            // With window groups a block's tokens are not the same tokens in every group.
            match self.groups_text() {
                None => format!(" = {} tokens", self.kv_tokens()),
                Some(_) => format!(" x {} layers", self.layers_per_block),
            },
            self.kv_dtype.name(),
            self.kv_bytes as f64 / GIB,
            self.max_model_len,
            self.max_concurrency(),
            self.budget_bytes as f64 / GIB,
            self.utilization,
            self.device_bytes as f64 / GIB,
            self.weight_bytes as f64 / GIB,
            self.activation_bytes as f64 / GIB,
            self.groups_text()
                .map_or(String::new(), |g| format!("; KV groups: {g}")),
        )?;
        if self.explicit_kv {
            write!(f, " (pool set by --kv-cache-memory)")?;
        }
        if self.state_slots > 0 {
            let n = self.state_slots + self.state_checkpoints + self.state_draft_slots;
            write!(
                f,
                "; recurrent state: {} slots + {} prefix-cache checkpoints + {} draft slots x {:.2} MiB = {:.2} GiB",
                self.state_slots,
                self.state_checkpoints,
                self.state_draft_slots,
                self.state_bytes as f64 / n as f64 / (1 << 20) as f64,
                self.state_bytes as f64 / GIB
            )?;
        }
        if let Some(d) = self.draft {
            write!(
                f,
                "; of these, the draft model's: weights {:.3} GiB, K/V {:.3} GiB ({:.0}% of each block)",
                d.weight_bytes as f64 / GIB,
                (d.bytes_per_block * self.num_blocks as u64) as f64 / GIB,
                100.0 * d.bytes_per_block as f64 / self.bytes_per_block as f64
            )?;
        }
        if self.capped {
            write!(f, " (capped at max_num_seqs full-length requests)")?;
        }
        if self.binding_cap {
            write!(f, " (capped at what one layer's storage binding holds)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> PlanInputs {
        PlanInputs {
            device_bytes: 8 << 30,
            utilization: 0.5,
            kv_cache_memory: None,
            weight_bytes: 1 << 30,
            activation_bytes: 1 << 28,
            bytes_per_block: 1 << 20,
            kv_dtype: KvCacheDtype::Fp16,
            block_size: 16,
            max_model_len: 4096,
            max_num_seqs: 1000,
            kv_groups: vec![None],
            layers_per_block: 30,
            chunk: 512,
            state_bytes_per_slot: 0,
            draft: None,
            state_checkpoints: 0,
            state_draft_slots: 0,
            max_blocks: None,
        }
    }

    #[test]
    fn pool_is_budget_minus_weights_and_activations() {
        let p = plan(&inputs()).unwrap();
        assert_eq!(
            p.num_blocks,
            ((4u64 << 30) - (1 << 30) - (1 << 28)) as usize >> 20
        );
        assert_eq!(p.kv_tokens(), p.num_blocks * 16);
    }

    #[test]
    fn too_small_budget_names_the_numbers_and_a_fix() {
        let mut i = inputs();
        i.kv_cache_memory = Some(10 << 20);
        let e = plan(&i).unwrap_err().to_string();
        assert!(
            e.contains("--max-model-len 4096") && e.contains("256 blocks"),
            "{e}"
        );
        assert!(e.contains("lower --max-model-len to at most 160"), "{e}");
        i.kv_cache_memory = None;
        i.utilization = 0.1;
        let e = plan(&i).unwrap_err().to_string();
        assert!(e.contains("raise --gpu-memory-utilization"), "{e}");
    }

    /// A GPU whose storage bindings hold fewer blocks of a layer than the budget pays for
    /// gets that many, said so; fewer than one request needs is refused.
    #[test]
    fn pool_is_capped_at_what_one_binding_holds() {
        let free = plan(&inputs()).unwrap();
        let need = free.blocks_per_request;
        let p = plan(&PlanInputs {
            max_blocks: Some(need + 3),
            ..inputs()
        })
        .unwrap();
        assert!(free.num_blocks > need + 3);
        assert_eq!(p.num_blocks, need + 3);
        assert!(p.to_string().contains("one layer's storage binding"), "{p}");
        let e = plan(&PlanInputs {
            max_blocks: Some(need - 1),
            ..inputs()
        })
        .unwrap_err();
        assert!(e.to_string().contains("lower --max-model-len"), "{e}");
    }

    #[test]
    fn gemma3_window_groups_hold_five_times_the_requests_of_all_global_layers() {
        // Gemma 3 270M: 18 layers, 1 KV head of 256, 5 local (window 512) to 1 global.
        let windows: Vec<GroupWindow> =
            (0..18).map(|i| ((i + 1) % 6 != 0).then_some(512)).collect();
        let row_bytes = 2 * 256 * 2; // K and V of one layer's token, f16
        let plan_for = |windows: &[GroupWindow]| {
            let layout = ferrite_core::kv_layout::KvLayout::new(windows);
            plan(&PlanInputs {
                kv_cache_memory: Some(1 << 30),
                bytes_per_block: (16 * row_bytes * layout.slots) as u64,
                max_model_len: 32768,
                kv_groups: layout.groups.clone(),
                layers_per_block: layout.slots,
                ..inputs()
            })
            .unwrap()
        };
        let (hybrid, global) = (plan_for(&windows), plan_for(&[None; 18]));
        println!("{hybrid}\n{global}");
        assert!(hybrid
            .to_string()
            .contains("1 global + 5 sliding-window (512) groups of 3 layers"));
        // 2048 + 5 x 65 blocks of 3 layers vs 2048 blocks of 18: 5.2x the concurrency.
        let ratio = hybrid.max_concurrency() / global.max_concurrency();
        assert!((5.1..5.3).contains(&ratio), "{ratio}");
    }

    #[test]
    fn pool_is_capped_at_what_max_num_seqs_can_use() {
        let mut i = inputs();
        i.max_num_seqs = 2;
        let p = plan(&i).unwrap();
        assert!(p.capped);
        assert_eq!(p.num_blocks, 2 * 256);
    }
}
