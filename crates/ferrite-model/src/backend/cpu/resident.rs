//! Buffers allocated once at start-up (the KV pool) and made resident in the background.

use half::{bf16, f16};
use rayon::prelude::*;
use std::alloc::Layout;

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

/// `n` zeros whose every page becomes resident right after start-up, so RSS does not grow
/// with load; in huge pages where the kernel gives them. Faulting a 6 GB pool in takes the
/// kernel ~15 s on 2 cores: it happens in the background (`MADV_POPULATE_WRITE`, which never
/// writes a byte, so it may run while requests fill the pool), and serving starts at once.
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

/// Faults `buf`'s pages in on the populating thread, 64 MiB at a time, without touching
/// their contents; false when the kernel cannot (then nothing was queued). A buffer under a
/// page is left as it is.
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
                // Behind the model's threads: serving comes first, the pool fills meanwhile.
                // SAFETY: changes this thread's scheduling priority only.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
                for (mut at, last) in rx {
                    // Stops at the first failure: the buffer was freed (a re-sized cache).
                    while at < last && populate(at, (at + POPULATE_STEP).min(last)) {
                        at += POPULATE_STEP;
                    }
                }
            })
            .expect("spawn the KV populating thread");
        std::sync::Mutex::new(tx)
    });
    let _ = queue.lock().unwrap().send((first + PAGE, last));
    true
}

const PAGE: usize = 4096;
const POPULATE_STEP: usize = 64 << 20;

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
