//! Opening a GPU through wgpu: the adapter `--device` names, the features and limits the
//! kernels need, and the memory the budget is a share of.

use super::binds::BindGroups;
use super::profile::{self, Profiler};
use crate::settings::GpuApi;
use anyhow::{bail, Context, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// An open GPU: the device, its queue, what the adapter reported.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// What the budget is a share of: dedicated memory, or on unified memory (Apple) the
    /// working set the system recommends.
    pub memory_bytes: u64,
    /// The first error the driver reported, taken at the end of each step.
    errors: Arc<Mutex<Option<String>>>,
    /// Bytes of activation buffers allocated (they are kept and reused).
    activations: AtomicU64,
    /// Timestamps around every launch, when asked for.
    pub profiler: Option<Mutex<Profiler>>,
    /// Whether the matmul on cooperative matrices runs here.
    pub coop: bool,
    pub binds: Mutex<BindGroups>,
}

fn backends(api: GpuApi) -> wgpu::Backends {
    match api {
        GpuApi::Vulkan => wgpu::Backends::VULKAN,
        GpuApi::Metal => wgpu::Backends::METAL,
        GpuApi::Native => wgpu::Backends::VULKAN | wgpu::Backends::METAL,
    }
}

/// What every adapter must offer: parameters in immediates (push constants), subgroup
/// operations (sums across a SIMD group).
fn needed() -> wgpu::Features {
    wgpu::Features::IMMEDIATES | wgpu::Features::SUBGROUP
}

fn coop_features() -> wgpu::Features {
    wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16
}

/// Whether the adapter multiplies 16 x 16 f16 tiles into f32 sums in subgroups of exactly 32
/// lanes with room for the kernel's 24 KiB of workgroup memory (matmul_coop.wgsl).
fn has_coop(adapter: &wgpu::Adapter) -> bool {
    let info = adapter.get_info();
    let tile = adapter.cooperative_matrix_properties().iter().any(|c| {
        (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
            && c.ab_type == wgpu::CooperativeScalarType::F16
            && c.cr_type == wgpu::CooperativeScalarType::F32
    });
    tile && adapter.features().contains(coop_features())
        && (info.subgroup_min_size, info.subgroup_max_size) == (32, 32)
        && adapter.limits().max_compute_workgroup_storage_size >= 24 << 10
}

impl Gpu {
    /// The `index`-th adapter of `api`.
    pub fn open(api: GpuApi, index: usize) -> Result<Arc<Self>> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backends(api);
        let instance = wgpu::Instance::new(desc);
        let adapters = pollster::block_on(instance.enumerate_adapters(backends(api)));
        if adapters.is_empty() {
            bail!(
                "--device {}: no {} adapter found ({})",
                api.name(),
                api_label(api),
                install_hint(api)
            );
        }
        let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        let Some(adapter) = adapters.into_iter().nth(index) else {
            bail!(
                "--device {}:{index}: there are {} adapters ({})",
                api.name(),
                names.len(),
                names.join(", ")
            );
        };
        let info = adapter.get_info();
        let missing = needed() - adapter.features();
        if !missing.is_empty() {
            bail!(
                "{} ({:?}, driver {}) lacks {missing:?}, which ferrite's kernels need",
                info.name,
                info.backend,
                info.driver
            );
        }
        let profiling = profile::wanted() && adapter.features().contains(profile::features());
        if profile::wanted() && !profiling {
            tracing::warn!("{}: no timestamps inside passes, no profile", info.name);
        }
        let mut features = match profiling {
            true => needed() | profile::features(),
            false => needed(),
        };
        let coop = has_coop(&adapter);
        if coop {
            features |= coop_features();
        }
        let limits = adapter.limits();
        let memory_bytes = memory::adapter_bytes(&adapter)?;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("ferrite"),
            required_features: features,
            required_limits: limits.clone(),
            // SAFETY: the experimental feature asked for (cooperative matrices) is used by
            // one kernel, whose shader naga validates at start-up like any other.
            experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
            ..Default::default()
        }))
        .with_context(|| format!("opening {}", info.name))?;
        let errors = Arc::new(Mutex::new(None));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut first = sink.lock().unwrap_or_else(|p| p.into_inner());
            first.get_or_insert_with(|| e.to_string());
        }));
        let profiler = profiling.then(|| Mutex::new(Profiler::new(&device, &queue)));
        Ok(Arc::new(Self {
            profiler,
            coop,
            binds: Mutex::default(),
            device,
            queue,
            info,
            limits,
            memory_bytes,
            errors,
            activations: AtomicU64::new(0),
        }))
    }

    pub fn activation_bytes(&self) -> u64 {
        self.activations.load(Ordering::Relaxed)
    }

    /// Counts a new activation buffer replacing one of `old` bytes.
    pub fn count_activations(&self, new: u64, old: u64) {
        self.activations.fetch_add(new, Ordering::Relaxed);
        self.activations.fetch_sub(old, Ordering::Relaxed);
    }

    /// The first error the driver reported since the last call.
    pub fn take_error(&self) -> Result<()> {
        let mut first = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        match first.take() {
            Some(e) => bail!("{}: {e}", self.info.name),
            None => Ok(()),
        }
    }

    /// `vulkan:0 (NVIDIA H100, driver 570.1)`, as the start-up line names it.
    pub fn describe(&self) -> String {
        let i = &self.info;
        format!(
            "{} ({:?}, {}{}, {:.1} GiB, bindings up to {} MiB{})",
            i.name,
            i.backend,
            i.driver,
            match i.driver_info.is_empty() {
                true => String::new(),
                false => format!(" {}", i.driver_info),
            },
            self.memory_bytes as f64 / (1u64 << 30) as f64,
            self.limits.max_storage_buffer_binding_size >> 20,
            match self.coop {
                true => ", cooperative matrices",
                false => "",
            }
        )
    }
}

fn api_label(api: GpuApi) -> &'static str {
    match api {
        GpuApi::Vulkan => "Vulkan",
        GpuApi::Metal => "Metal",
        GpuApi::Native => "Vulkan or Metal",
    }
}

fn install_hint(api: GpuApi) -> &'static str {
    match api {
        GpuApi::Metal => "Metal needs macOS on a Mac with a GPU",
        _ => "install the GPU's Vulkan driver and loader (Debian: libvulkan1 and mesa-vulkan-drivers or the vendor's driver); `vulkaninfo --summary` lists what the loader sees",
    }
}

mod memory {
    use anyhow::Result;

    /// The largest device-local heap (on an integrated GPU: the host memory it shares).
    #[cfg(not(target_vendor = "apple"))]
    pub fn adapter_bytes(adapter: &wgpu::Adapter) -> Result<u64> {
        use anyhow::Context;
        // SAFETY: the raw handles are only read, while `adapter` lives.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }
            .context("this build reads device memory through Vulkan only")?;
        let instance = hal.shared_instance().raw_instance();
        // SAFETY: a valid physical device of this instance.
        let props =
            unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
        let heaps = &props.memory_heaps[..props.memory_heap_count as usize];
        heaps
            .iter()
            .filter(|h| h.flags.contains(ash::vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .max()
            .context("the adapter reports no device-local memory")
    }

    /// Apple's unified memory: the working set Metal recommends for one process, as
    /// vllm-metal budgets.
    #[cfg(target_vendor = "apple")]
    pub fn adapter_bytes(adapter: &wgpu::Adapter) -> Result<u64> {
        use anyhow::Context;
        use objc2_metal::MTLDevice;
        // SAFETY: the raw handle is only read, while `adapter` lives.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Metal>() }
            .context("this build reads device memory through Metal only")?;
        Ok(hal.raw_device().recommendedMaxWorkingSetSize())
    }
}
