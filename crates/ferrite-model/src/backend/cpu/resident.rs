//! Buffers allocated once at start-up (the KV pool) and made resident in the background.

use half::{bf16, f16};
use rayon::prelude::*;
use std::alloc::Layout;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Element types whose all-zero bits are the value zero.
pub trait ZeroBits: Copy + Send + Sync {
    const ZERO: Self;
}

impl ZeroBits for f16 {
    const ZERO: Self = f16::ZERO;
}
impl ZeroBits for bf16 {
    const ZERO: Self = bf16::ZERO;
}
impl ZeroBits for u8 {
    const ZERO: Self = 0;
}
impl ZeroBits for i8 {
    const ZERO: Self = 0;
}
impl ZeroBits for f32 {
    const ZERO: Self = 0.0;
}

/// `n` zeros whose pages become resident soon after start-up, in huge pages where the kernel
/// gives them. Faulting a 6 GB pool in takes the kernel ~15 s on 2 cores: it happens in the
/// background (`MADV_POPULATE_WRITE`, which never writes a byte, so it may run while requests
/// fill the pool) whenever no step runs, and serving starts at once.
/// Where the kernel lacks it, every page is touched here instead.
pub fn resident_zeros<T: ZeroBits>(n: usize) -> Vec<T> {
    let mut v = match Layout::array::<T>(n) {
        Ok(layout) if layout.size() > 0 => {
            // SAFETY: the allocation has `T`'s layout for `n` elements, and zero bits are a
            // valid `T` (`ZeroBits`); calloc'd pages stay untouched until populated.
            unsafe {
                let p = std::alloc::alloc_zeroed(layout).cast::<T>();
                if p.is_null() {
                    std::alloc::handle_alloc_error(layout);
                }
                Vec::from_raw_parts(p, n, n)
            }
        }
        Ok(_) => Vec::new(),
        Err(_) => panic!("a KV buffer of {n} elements overflows the address space"),
    };
    huge_pages(&mut v);
    if !populate_in_background(&v) {
        let per_page = (PAGE / std::mem::size_of::<T>()).max(1);
        v.par_chunks_mut(per_page).for_each(|c| c[0] = T::ZERO);
    }
    v
}

/// Queues `buf`'s pages for the populating thread, which faults them in without touching
/// their contents; false when the kernel cannot (then nothing was queued). A buffer under a
/// page is left as it is.
///
/// The thread takes a huge page of each queued buffer in turn: the KV pool is one buffer per
/// layer, blocks are handed out from the lowest, so the blocks the first requests get become
/// resident in every layer first (a request never waits on a layer whose pages are not).
fn populate_in_background<T>(buf: &[T]) -> bool {
    let (start, len) = (buf.as_ptr() as usize, std::mem::size_of_val(buf));
    let (first, last) = (start.next_multiple_of(PAGE), (start + len) / PAGE * PAGE);
    // One page here: whether the kernel takes the advice at all.
    if last <= first || !populate(first, first + PAGE) {
        return last <= first;
    }
    static QUEUE: std::sync::OnceLock<std::sync::Mutex<std::sync::mpsc::Sender<(usize, usize)>>> =
        std::sync::OnceLock::new();
    let queue = QUEUE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<(usize, usize)>();
        std::thread::Builder::new()
            .name("kv-populate".into())
            .spawn(move || {
                background_priority();
                populate_round_robin(rx);
            })
            .expect("spawn the KV populating thread");
        std::sync::Mutex::new(tx)
    });
    let _ = queue.lock().unwrap().send((first + PAGE, last));
    true
}

/// Populates the ranges `rx` brings, a step of each in turn, until the sender is gone. A
/// range whose step fails is dropped: its buffer was freed (a re-sized cache).
fn populate_round_robin(rx: std::sync::mpsc::Receiver<(usize, usize)>) {
    let mut pending = std::collections::VecDeque::new();
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(r) => pending.push_back(r),
                Err(_) => return,
            }
        }
        pending.extend(rx.try_iter());
        let Some((at, last)) = pending.pop_front() else {
            continue;
        };
        wait_for_idle();
        let end = (at + POPULATE_STEP).min(last);
        if populate(at, end) && end < last {
            pending.push_back((end, last));
        }
    }
}

/// Steps running now, and when the last one ended (ms from [`epoch`]).
static STEPS: AtomicUsize = AtomicUsize::new(0);
static LAST_STEP_END: AtomicU64 = AtomicU64::new(0);
/// Quiet time after a step before populating resumes: decode steps follow each other
/// closer than this, so a burst runs with every core and all the memory bandwidth to itself
/// (even an idle-class thread zeroing pages slowed steps 1.5x on 2 cores), and its own
/// blocks fault in as it first writes them.
const QUIET: Duration = Duration::from_millis(50);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Held while a model step runs: the populating thread waits until steps have stopped.
pub struct StepRunning(());

/// Marks a step as running until the result is dropped.
pub fn step_running() -> StepRunning {
    STEPS.fetch_add(1, Ordering::SeqCst);
    StepRunning(())
}

impl Drop for StepRunning {
    fn drop(&mut self) {
        LAST_STEP_END.store(epoch().elapsed().as_millis() as u64, Ordering::SeqCst);
        STEPS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Returns once no step runs and none has ended for [`QUIET`].
fn wait_for_idle() {
    loop {
        let now = epoch().elapsed().as_millis() as u64;
        let since = now.saturating_sub(LAST_STEP_END.load(Ordering::SeqCst));
        if STEPS.load(Ordering::SeqCst) == 0 && since >= QUIET.as_millis() as u64 {
            return;
        }
        std::thread::sleep(QUIET / 5);
    }
}

/// Behind the model's threads: serving comes first, the pool fills when a core is idle
/// (Linux's idle class; elsewhere the lowest nice level).
fn background_priority() {
    #[cfg(target_os = "linux")]
    {
        let idle = libc::sched_param { sched_priority: 0 };
        // SAFETY: changes this thread's scheduling class only.
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) } == 0 {
            return;
        }
    }
    // SAFETY: changes this thread's scheduling priority only.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
}

const PAGE: usize = 4096;
/// A huge page: the unit the kernel backs the pool with where it can.
const POPULATE_STEP: usize = 2 << 20;

/// Makes `[from, to)` resident as if written, writing nothing; false on failure (and on
/// kernels other than Linux: then every page is touched at start-up).
#[cfg(not(target_os = "linux"))]
fn populate(_from: usize, _to: usize) -> bool {
    false
}

/// Makes `[from, to)` resident as if written, writing nothing; false on failure.
#[cfg(target_os = "linux")]
fn populate(from: usize, to: usize) -> bool {
    // SAFETY: the advice only makes pages of this process resident (ENOMEM once the range is
    // unmapped); no byte is read or written.
    unsafe {
        libc::madvise(
            from as *mut libc::c_void,
            to - from,
            libc::MADV_POPULATE_WRITE,
        ) == 0
    }
}

/// Asks for transparent huge pages over `buf`'s whole 2 MiB pages (a hint: where the kernel
/// has them off, or is not Linux, nothing changes).
fn huge_pages<T>(buf: &mut [T]) {
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
    #[cfg(target_os = "linux")]
    huge_pages_linux(buf);
}

#[cfg(target_os = "linux")]
fn huge_pages_linux<T>(buf: &mut [T]) {
    const HUGE: usize = 2 << 20;
    let start = buf.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(buf);
    let (first, last) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if last > first {
        // SAFETY: the range lies inside `buf`, which this process owns; MADV_HUGEPAGE only
        // changes how the kernel backs it.
        unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                last - first,
                libc::MADV_HUGEPAGE,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The populating thread waits while a step runs and resumes once steps stop.
    #[test]
    fn populating_waits_for_steps_to_stop() {
        let step = step_running();
        let waiter = std::thread::spawn(wait_for_idle);
        std::thread::sleep(4 * QUIET);
        assert!(!waiter.is_finished(), "populating went on during a step");
        drop(step);
        let t0 = Instant::now();
        waiter.join().unwrap();
        assert!(t0.elapsed() >= QUIET / 2, "resumed before the quiet time");
    }
}
