//! The CPU's int8 dot-product peak: `vpdpbusd` (64 u8 x i8 products into 16 i32 lanes per
//! instruction) on 12 independent 512-bit accumulators, from registers only, on 1 thread and
//! on THREADS threads at once; where the CPU has AMX, also `tdpbusd` from tiles only, with the
//! unit's full 64-code products and with one block of 32 per product (what the matmul
//! takes). The ceilings the int8 matmul kernels are compared against.
//! Usage: cargo run --release -p ferrite-model --example int8_peak -- [THREADS]

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::main();
    #[cfg(not(target_arch = "x86_64"))]
    println!("vpdpbusd and AMX are x86 instructions: no peak to measure on this CPU");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use ferrite_model::backend::cpu::quant::tile_peak;
    use ferrite_model::backend::cpu::quant::Isa;
    use std::time::Instant;

    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dots(iters: usize) -> i32 {
        use std::arch::x86_64::*;
        let a = _mm512_set1_epi8(3);
        let b = _mm512_set1_epi8(-2);
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_dpbusd_epi32(*x, a, b);
            }
        }
        let mut s = _mm512_setzero_si512();
        for x in acc {
            s = _mm512_add_epi32(s, x);
        }
        _mm512_reduce_add_epi32(s)
    }

    /// Operations (multiply + add = 2) per second over `threads` threads.
    fn peak(threads: usize) -> f64 {
        let iters = 20_000_000;
        let t = Instant::now();
        let sums: Vec<i32> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                // SAFETY: main checked that the CPU has AVX-512 VNNI.
                .map(|_| s.spawn(move || unsafe { dots(iters) }))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let secs = t.elapsed().as_secs_f64();
        assert!(sums.iter().all(|&x| x != 0));
        (threads * iters * 12 * 64 * 2) as f64 / secs
    }

    pub fn main() {
        let threads: usize = std::env::args().nth(1).map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |s| s.parse().unwrap(),
        );
        if !Isa::Avx512Vnni.supported() {
            println!("no AVX-512 VNNI on this CPU: no vpdpbusd peak to measure");
            return;
        }
        let one = peak(1);
        let all = peak(threads);
        println!(
            "vpdpbusd peak: {:.0} GOP/s on 1 thread, {:.0} GOP/s on {threads} threads",
            one / 1e9,
            all / 1e9
        );
        if Isa::Amx.supported() {
            let tiles = |k: usize| -> f64 {
                std::thread::scope(|s| {
                    let handles: Vec<_> = (0..threads)
                        .map(|_| s.spawn(move || tile_peak(k, 2_000_000).unwrap()))
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).sum()
                })
            };
            let (full, block) = (tiles(64), tiles(32));
            println!(
                "amx peak: {:.0} GOP/s on {threads} threads with blocks of 32 per product \
                 ({:.0} GOP/s with the unit's full 64)",
                block / 1e9,
                full / 1e9
            );
        }
    }
}
