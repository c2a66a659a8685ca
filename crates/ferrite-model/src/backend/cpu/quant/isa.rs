//! Which instruction set the CPU kernels use, detected once at run time.

use super::packed::Layout;
use std::sync::OnceLock;

/// Kernel instruction sets, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AMX tiles for the int8 matmul (whole-block dots of 16 tokens x 16 rows), AVX-512 for
    /// the rest.
    Amx,
    /// 512-bit registers with `vpdpbusd` (u8 x i8 dot products into i32).
    Avx512Vnni,
    /// 256-bit `vpmaddubsw` + `vpmaddwd`, FMA.
    Avx2,
    /// Arm `smmla` (two weight rows x two tokens x 8 int8 values per instruction): Apple M2
    /// and later, Neoverse V1/V2/N2 (Graviton 3 and 4, Grace).
    NeonI8mm,
    /// Arm `sdot` (four int8 products into each 32-bit lane): Apple M1, Neoverse N1.
    NeonDotprod,
    /// Arm NEON alone: `smull` + `sadalp`.
    Neon,
    /// Plain Rust, for any CPU.
    Portable,
}

/// Environment variable that forces a slower kernel set (benchmarks, debugging).
pub const ISA_ENV: &str = "FERRITE_CPU_ISA";

impl Isa {
    /// The weight layout this kernel set reads.
    pub fn layout(self) -> Layout {
        match self {
            Isa::Amx | Isa::Avx512Vnni => Layout::Panels,
            _ => Layout::Rows,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Isa::Amx => "amx",
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::Avx2 => "avx2",
            Isa::NeonI8mm => "neon-i8mm",
            Isa::NeonDotprod => "neon-dotprod",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }

    /// True when this CPU can run the kernel set.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Amx => Isa::Avx512Vnni.supported() && super::amx::available(),
                Isa::Avx512Vnni => {
                    has!("avx512f")
                        && has!("avx512bw")
                        && has!("avx512vl")
                        && has!("avx512vnni")
                        && has!("fma")
                        && has!("f16c")
                }
                Isa::Avx2 => has!("avx2") && has!("fma") && has!("f16c"),
                Isa::Portable => true,
                _ => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            use std::arch::is_aarch64_feature_detected as has;
            match self {
                Isa::NeonI8mm => has!("i8mm"),
                Isa::NeonDotprod => has!("dotprod"),
                Isa::Neon | Isa::Portable => true,
                _ => false,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            self == Isa::Portable
        }
    }

    /// The vector set beside the matmul tiles: what attention and the KV cache use.
    pub fn vector(self) -> Isa {
        match self {
            Isa::Amx => Isa::Avx512Vnni,
            Isa::NeonI8mm | Isa::NeonDotprod => Isa::Neon,
            isa => isa,
        }
    }

    /// Every kernel set this CPU can run, fastest first.
    pub fn available() -> Vec<Isa> {
        [
            Isa::Amx,
            Isa::Avx512Vnni,
            Isa::Avx2,
            Isa::NeonI8mm,
            Isa::NeonDotprod,
            Isa::Neon,
            Isa::Portable,
        ]
        .into_iter()
        .filter(|i| i.supported())
        .collect()
    }

    /// The fastest supported set, or the one named by `FERRITE_CPU_ISA` when the CPU has it.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Isa::available()[0];
            match std::env::var(ISA_ENV) {
                Ok(want) => match Isa::available().into_iter().find(|i| i.name() == want) {
                    Some(i) => i,
                    None => {
                        tracing::warn!(
                            "{ISA_ENV}={want} is not available here; using {}",
                            best.name()
                        );
                        best
                    }
                },
                Err(_) => best,
            }
        })
    }
}
