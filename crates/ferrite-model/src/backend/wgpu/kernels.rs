//! The compute pipelines, one per WGSL entry point, and how a launch binds its buffers:
//! parameters go in immediates, buffers in one bind group made per launch.

use super::device::Gpu;
use super::profile;
use anyhow::Result;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use wgpu::util::DeviceExt;

/// A pipeline and the layout of its buffers.
pub struct Kernel {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    name: &'static str,
}

/// Every kernel, built once per device.
pub struct Kernels {
    pub rms_norm: Kernel,
    pub layer_norm: Kernel,
    /// By weight format.
    pub embed: Vec<Kernel>,
    /// By weight format ([`super::blocks::Format`]).
    pub matmul: Vec<Kernel>,
    /// By weight format, on cooperative matrices; empty where the adapter has none.
    pub matmul_coop: Vec<Kernel>,
    /// By weight format, then rows of x (1 to [`GEMV_ROWS`]).
    pub gemv: Vec<Vec<Kernel>>,
    /// Whether the adapter is a CPU (lavapipe): fewer, larger workgroups.
    cpu: bool,
    pub gated: Kernel,
    pub gate_sigmoid: Kernel,
    pub add_bias: Kernel,
    pub softcap: Kernel,
    pub qkv: Kernel,
    pub attention_combine: Kernel,
    /// Gated delta-net layers: a checkpoint's state restored, the convolution, its window's
    /// slide.
    pub gdn_restore: Kernel,
    pub gdn_conv: Kernel,
    pub gdn_slide: Kernel,
    /// Kernels specialized by a model's sizes (attention by head, the delta rule by key and
    /// value head), built when a model first asks: by file and override values.
    specialized: Mutex<HashMap<Specialization, Arc<Kernel>>>,
    /// Mixtures of experts: each token's experts, and the experts' outputs summed.
    pub moe_route: Kernel,
    pub moe_combine: Kernel,
    /// A token per logits row, drawn on the device.
    pub sample: Kernel,
    /// Bound where a kernel's optional input is absent.
    pub empty: wgpu::Buffer,
}

/// A kernel's file and the values of its overrides.
type Specialization = (&'static str, Vec<usize>);

/// Bytes of the largest parameter block.
const IMMEDIATES: u32 = 64;

/// Most rows of x the matrix-vector kernel takes; more go through tiles.
pub const GEMV_ROWS: usize = 8;

/// The matrix-vector kernel's rows of w for `m` rows of x: taken at once by a subgroup (each
/// load of x serves them all), and per workgroup: two subgroups' on a GPU (workgroups of 64
/// lanes, subgroups of 32), 16 on a CPU (or as `FERRITE_WGPU_GEMV` says, for tuning).
fn gemv_shape(m: usize, cpu: bool) -> (usize, usize) {
    let r = match m {
        1 | 2 => 2,
        _ => 4,
    };
    match cpu {
        true => (r, 16),
        false => profile::gemv_shape().unwrap_or((r, 2 * r)),
    }
}

/// Weight formats the matmul kernels read (`FMT` in weights.wgsl).
pub const FORMATS: usize = 7;

/// `access`: one letter per binding, `r` read-only storage, `w` read-write; `constants`: the
/// shader's overridable constants.
fn kernel(
    device: &wgpu::Device,
    module: &wgpu::ShaderModule,
    (name, entry): (&'static str, &str),
    access: &str,
    constants: &[(&str, f64)],
) -> Kernel {
    let entries: Vec<_> = access
        .bytes()
        .enumerate()
        .map(|(i, a)| wgpu::BindGroupLayoutEntry {
            binding: i as u32,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage {
                    read_only: a == b'r',
                },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        })
        .collect();
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some(name),
        entries: &entries,
    });
    let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(name),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: IMMEDIATES,
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(name),
        layout: Some(&pipeline_layout),
        module,
        entry_point: Some(entry),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants,
            ..Default::default()
        },
        cache: None,
    });
    Kernel {
        pipeline,
        layout,
        name,
    }
}

/// The WGSL sources, by file.
pub const SHADERS: [(&str, &str); 14] = [
    (
        "rms_norm",
        concat!(
            include_str!("shaders/reduce.wgsl"),
            include_str!("shaders/rms_norm.wgsl")
        ),
    ),
    (
        "layer_norm",
        concat!(
            include_str!("shaders/reduce.wgsl"),
            include_str!("shaders/layer_norm.wgsl")
        ),
    ),
    (
        "embed",
        concat!(
            include_str!("shaders/weights.wgsl"),
            include_str!("shaders/embed.wgsl")
        ),
    ),
    (
        "matmul",
        concat!(
            include_str!("shaders/weights.wgsl"),
            include_str!("shaders/linear_params.wgsl"),
            include_str!("shaders/matmul.wgsl")
        ),
    ),
    (
        "gemv",
        concat!(
            include_str!("shaders/weights.wgsl"),
            include_str!("shaders/linear_params.wgsl"),
            include_str!("shaders/activations.wgsl"),
            include_str!("shaders/gemv.wgsl")
        ),
    ),
    (
        "pointwise",
        concat!(
            include_str!("shaders/activations.wgsl"),
            include_str!("shaders/pointwise.wgsl")
        ),
    ),
    (
        "qkv",
        concat!(
            include_str!("shaders/reduce.wgsl"),
            include_str!("shaders/qkv.wgsl")
        ),
    ),
    (
        "attention",
        concat!(
            include_str!("shaders/reduce.wgsl"),
            include_str!("shaders/requests.wgsl"),
            include_str!("shaders/attention.wgsl")
        ),
    ),
    (
        "attention_combine",
        include_str!("shaders/attention_combine.wgsl"),
    ),
    (
        "gdn",
        concat!(
            include_str!("shaders/requests.wgsl"),
            include_str!("shaders/gdn.wgsl")
        ),
    ),
    ("moe_route", include_str!("shaders/moe_route.wgsl")),
    ("moe_combine", include_str!("shaders/moe_combine.wgsl")),
    (
        "sample",
        concat!(
            include_str!("shaders/reduce.wgsl"),
            include_str!("shaders/sample.wgsl")
        ),
    ),
    (
        "gdn_rule",
        concat!(
            include_str!("shaders/reduce.wgsl"),
            include_str!("shaders/gdn_rule.wgsl")
        ),
    ),
];

/// The matmul on cooperative matrices (16 x 16 f16 tiles, f32 sums: Vulkan's
/// VK_KHR_cooperative_matrix), built where the adapter has them.
pub const COOP_SHADER: &str = concat!(
    "enable f16;\nenable wgpu_cooperative_matrix;\n",
    include_str!("shaders/weights.wgsl"),
    include_str!("shaders/linear_params.wgsl"),
    include_str!("shaders/matmul_coop.wgsl")
);

fn module(device: &wgpu::Device, name: &str) -> wgpu::ShaderModule {
    let source = SHADERS.iter().find(|(n, _)| *n == name).map(|s| s.1);
    compile(device, name, source.unwrap_or_default())
}

/// A module without the loop counters wgpu adds to every loop by default: they keep the
/// driver from unrolling the kernels' loops, and the arrays those loops index (a thread's
/// sums, its blocks in flight) then live in memory instead of registers. Buffer accesses
/// stay bounds-checked.
fn compile(device: &wgpu::Device, label: &str, source: &str) -> wgpu::ShaderModule {
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    };
    let checks = wgpu::ShaderRuntimeChecks {
        force_loop_bounding: false,
        ..wgpu::ShaderRuntimeChecks::checked()
    };
    // SAFETY: every loop of these shaders ends: its bounds are the launch's sizes, fixed
    // counts, or (the halvings of sample.wgsl) 32 steps.
    unsafe { device.create_shader_module_trusted(desc, checks) }
}

impl Kernels {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let device = &gpu.device;
        // A CPU adapter schedules each workgroup at a cost.
        let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
        let one = |file: &'static str, access: &str| {
            kernel(device, &module(device, file), (file, "main"), access, &[])
        };
        let pointwise = module(device, "pointwise");
        let pw = |entry: &'static str| kernel(device, &pointwise, (entry, entry), "rw", &[]);
        let gdn = module(device, "gdn");
        Ok(Self {
            cpu,
            rms_norm: one("rms_norm", "rrrw"),
            layer_norm: one("layer_norm", "rrw"),
            embed: {
                let m = module(device, "embed");
                (0..FORMATS)
                    .map(|f| kernel(device, &m, ("embed", "main"), "rrw", &[("FMT", f as f64)]))
                    .collect()
            },
            matmul: {
                let m = module(device, "matmul");
                (0..FORMATS)
                    .map(|f| kernel(device, &m, ("matmul", "main"), "rrw", &[("FMT", f as f64)]))
                    .collect()
            },
            matmul_coop: match gpu.coop {
                false => Vec::new(),
                true => {
                    let m = compile(device, "matmul_coop", COOP_SHADER);
                    let name = ("matmul_coop", "main");
                    (0..FORMATS)
                        .map(|f| kernel(device, &m, name, "rrw", &[("FMT", f as f64)]))
                        .collect()
                }
            },
            gemv: {
                let m = module(device, "gemv");
                let pipeline = |f: usize, rows: usize| {
                    let (r, per_workgroup) = gemv_shape(rows, cpu);
                    let c = [
                        ("FMT", f as f64),
                        ("M", rows as f64),
                        ("R", r as f64),
                        ("ROWS", per_workgroup as f64),
                    ];
                    kernel(device, &m, ("gemv", "main"), "rrwrr", &c)
                };
                (0..FORMATS)
                    .map(|f| (1..=GEMV_ROWS).map(|rows| pipeline(f, rows)).collect())
                    .collect()
            },
            gated: pw("gated"),
            gate_sigmoid: pw("gate_sigmoid"),
            add_bias: pw("add_bias"),
            softcap: pw("softcap"),
            qkv: one("qkv", "rrrrrrww"),
            attention_combine: one("attention_combine", "rw"),
            gdn_restore: kernel(device, &gdn, ("gdn_restore", "restore"), "rrw", &[]),
            gdn_conv: kernel(device, &gdn, ("gdn_conv", "conv"), "rrwrw", &[]),
            gdn_slide: kernel(device, &gdn, ("gdn_slide", "slide"), "rrw", &[]),
            specialized: Mutex::default(),
            moe_route: one("moe_route", "rw"),
            moe_combine: one("moe_combine", "rrrrw"),
            sample: one("sample", "rrrw"),
            empty: device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("empty"),
                contents: &[0; 16],
                usage: wgpu::BufferUsages::STORAGE,
            }),
        })
    }
}

impl Kernels {
    /// `file`'s kernel with `constants` set (its overrides), built once.
    fn specialized(
        &self,
        device: &wgpu::Device,
        (file, access): (&'static str, &str),
        constants: &[(&str, usize)],
    ) -> Arc<Kernel> {
        let key = (file, constants.iter().map(|c| c.1).collect());
        let mut built = self.specialized.lock().unwrap_or_else(|e| e.into_inner());
        let k = built.entry(key).or_insert_with(|| {
            let values: Vec<_> = constants.iter().map(|&(n, v)| (n, v as f64)).collect();
            let m = module(device, file);
            Arc::new(kernel(device, &m, (file, "main"), access, &values))
        });
        k.clone()
    }

    /// The delta rule for heads of `dk` keys and `dv` values (`dv` threads a workgroup).
    pub fn gdn_rule(&self, device: &wgpu::Device, dk: usize, dv: usize) -> Arc<Kernel> {
        let constants = [("DK", dk), ("WG", dv)];
        self.specialized(device, ("gdn_rule", "rrrrrrww"), &constants)
    }

    /// Attention over heads of `d` values.
    pub fn attention(&self, device: &wgpu::Device, d: usize) -> Arc<Kernel> {
        self.specialized(device, ("attention", "rrrrw"), &[("D", d)])
    }

    /// The matrix-vector kernel's rows of w per subgroup and per workgroup for `m` rows of x.
    pub fn gemv_shape(&self, m: usize) -> (usize, usize) {
        gemv_shape(m, self.cpu)
    }
}

/// Records `k` over `groups` workgroups with `buffers` bound in order (a bind group kept
/// across steps) and `params` (u32 words, f32 as their bits) as immediates.
pub fn launch(
    gpu: &Gpu,
    pass: &mut wgpu::ComputePass<'static>,
    k: &Kernel,
    buffers: &[&wgpu::Buffer],
    params: &[u32],
    groups: [u32; 3],
) {
    debug_assert!(params.len() * 4 <= IMMEDIATES as usize, "{}", k.name);
    if profile::skipped(k.name) {
        return;
    }
    let group = gpu.binds.lock().unwrap_or_else(|e| e.into_inner()).get(
        &gpu.device,
        (&k.layout, k.name),
        buffers,
    );
    let mut words = [0u32; IMMEDIATES as usize / 4];
    words[..params.len()].copy_from_slice(params);
    pass.set_pipeline(&k.pipeline);
    pass.set_bind_group(0, &group, &[]);
    pass.set_immediates(0, bytemuck::cast_slice(&words));
    let dispatch = |pass: &mut wgpu::ComputePass<'static>| {
        pass.dispatch_workgroups(groups[0], groups[1], groups[2])
    };
    match &gpu.profiler {
        Some(p) => p
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .around(pass, k.name, dispatch),
        None => dispatch(pass),
    }
}

/// Workgroups `n` apart, spread over two dimensions past the 65,535 limit of one (the kernel
/// numbers them `y * 65535 + x`).
pub fn spread(n: usize) -> [u32; 3] {
    match n <= 65535 {
        true => [n.max(1) as u32, 1, 1],
        false => [65535, n.div_ceil(65535) as u32, 1],
    }
}

/// Workgroups for `n` threads of 256, spread over two dimensions past the 65,535 limit of one.
pub fn groups_for(n: usize) -> [u32; 3] {
    spread(n.div_ceil(256))
}
