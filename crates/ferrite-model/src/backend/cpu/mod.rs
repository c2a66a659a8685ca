//! The CPU backend: ferrite's int8 kernels over weights repacked at load (or candle's f32
//! GEMM for float weights), the paged f16 KV cache and attention, on a dedicated thread
//! pool. Every op works row by row or tile by tile on fixed grids, so a row's bits never
//! depend on the other rows of its step.

pub mod attention;
pub mod disjoint;
pub mod gdn;
pub mod kv_cache;
pub mod linear;
mod mat;
pub mod moe;
pub mod ops;
pub mod quant;
mod resident;
pub mod start;

use super::{
    AttentionSpec, Backend, Epilogue, GdnParams, GdnSpec, LinearIn, MoeBytes, MoeMatrices, MoeSpec,
    Pointwise, QkvPrep, Rounding, Stack, Step,
};
use crate::kv_dtype::KvCacheDtype;
use crate::rope::{RopeSpec, RopeTable};
use crate::settings::{DeviceKind, WeightFormat};
use anyhow::{bail, Result};
use attention::{paged_attention, AttentionMeta, AttentionParams};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::QTensor;
use candle_core::Device;
use kv_cache::{CacheShape, LayerCache};
use linear::{project, Linear, LinearInput};
pub use mat::Mat;
use ops::{add_in_place, gated_mul, head_rms_norm, rms_norm, softcap};
use quant::activations::QuantizedActs;
use quant::Isa;
use std::sync::Arc;

/// The embedding table in its GGUF blocks: rows are dequantized as tokens look them up.
pub struct Embedding {
    table: QTensor,
    hidden: usize,
    /// A vocabulary shard's first row: ids outside it look up zeros. `None`: the whole
    /// table, where an id past its end is an error.
    first: Option<usize>,
}

impl Embedding {
    /// Row `ids[i]` of the table combined into row `i` of `out` by `put(out, table)`.
    fn rows(&self, ids: &[u32], out: &mut [f32], put: impl Fn(&mut f32, f32)) -> Result<()> {
        let h = self.hidden;
        let (dtype, data) = (self.table.dtype(), self.table.data()?);
        let row_bytes = h / dtype.block_size() * dtype.type_size();
        let vocab = data.len() / row_bytes.max(1);
        for (row, &id) in out.chunks_mut(h).zip(ids) {
            let id = match self.first {
                None if id as usize >= vocab => bail!("row {id} of a table of {vocab}"),
                None => id as usize,
                Some(first) => match (id as usize).checked_sub(first).filter(|&i| i < vocab) {
                    Some(i) => i,
                    None => {
                        row.iter_mut().for_each(|r| put(r, 0.0));
                        continue;
                    }
                },
            };
            let bytes = &data[id * row_bytes..][..row_bytes];
            let t = qtensor_from_ggml(dtype, bytes, vec![h], &Device::Cpu)?;
            let v = t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?;
            row.iter_mut().zip(v).for_each(|(r, v)| put(r, v));
        }
        Ok(())
    }
}

pub struct CpuBackend {
    format: WeightFormat,
    /// The threads that run steps: the forward pass starts on one of them, so its parallel
    /// ops split work by stealing instead of handing every op to the pool from outside
    /// (a wake-up per op); the HTTP side and tokenization never run here.
    pool: Arc<rayon::ThreadPool>,
    // Buffers of one step, grown to the largest step (the start-up profile runs one at the
    // full token budget) and reused, so later steps allocate nothing here.
    normed: Vec<f32>,
    acts: QuantizedActs,
    /// One projection's output when Q/K/V or gate/up are not stacked.
    part: Vec<f32>,
    proj: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// The rows that need logits.
    sel: Mat,
    logits: Vec<f32>,
    moe: moe::Scratch,
    /// The other ranks of a model split across processes.
    group: Option<crate::parallel::Group>,
}

impl CpuBackend {
    /// `threads`: compute threads (default: the cores this process may use).
    pub fn new(format: WeightFormat, threads: Option<usize>) -> Self {
        let threads =
            threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ferrite-compute-{i}"))
            .build()
            .expect("compute thread pool");
        Self::on_pool(format, Arc::new(pool))
    }

    /// A second backend on this one's threads (a draft model beside its target): two pools
    /// on the same cores would spin against each other at every hand-over.
    pub fn sharing_threads(&self, format: WeightFormat) -> Self {
        Self::on_pool(format, self.pool.clone())
    }

    fn on_pool(format: WeightFormat, pool: Arc<rayon::ThreadPool>) -> Self {
        Self {
            format: format.resolve_cpu(),
            pool,
            normed: Vec::new(),
            acts: QuantizedActs::default(),
            part: Vec::new(),
            proj: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            sel: Mat::default(),
            logits: Vec::new(),
            moe: moe::Scratch::default(),
            group: None,
        }
    }

    /// This backend as one rank of `group`.
    pub fn in_group(self, group: crate::parallel::Group) -> Self {
        Self {
            group: Some(group),
            ..self
        }
    }

    /// Runs `w` on `input` into `out` (reused).
    fn project_into(
        &mut self,
        input: LinearIn<Self>,
        w: &[Linear],
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (x, cols) = match input {
            LinearIn::Plain(x) => (&x.data[..], x.cols),
            LinearIn::RmsNorm { x, norm, eps } => {
                self.normed.resize(x.data.len(), 0.0);
                rms_norm(&x.data, norm, eps, &mut self.normed);
                (&self.normed[..], x.cols)
            }
        };
        let rows = x.len().checked_div(cols).unwrap_or(0);
        let rounding = w.first().map_or(Rounding::Coarse, Linear::input_rounding);
        let input = LinearInput::new(x, rows, cols, rounding, &mut self.acts);
        project(w, &input, out, &mut self.part)
    }
}

fn width(w: &[Linear]) -> usize {
    w.iter().map(Linear::out_features).sum()
}

impl Backend for CpuBackend {
    type Act = Mat;
    type Vector = Vec<f32>;
    /// Stacked when their forms match, else one per part (sharing one input quantization).
    type Linear = Vec<Linear>;
    type Embedding = Embedding;
    type Rope = RopeTable;
    type Moe = moe::Moe;
    type LayerCache = LayerCache;
    type StateCache = gdn::StateCache;
    type StepInputs = ();

    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>> {
        Ok(v)
    }

    /// `[gate; up]` stacked by rows: [`gated_mul`] reads each row as `[gate | up]`.
    fn linear(&self, parts: Vec<QTensor>, _stack: Stack, input: Rounding) -> Result<Vec<Linear>> {
        Linear::projections(parts, self.format, input)
    }

    fn embedding(&self, table: QTensor) -> Result<Embedding> {
        let (_, hidden) = table.shape().dims2()?;
        Ok(Embedding {
            table,
            hidden,
            first: None,
        })
    }

    fn vocab_embedding(&self, table: QTensor, first: usize) -> Result<Embedding> {
        Ok(Embedding {
            first: Some(first),
            ..self.embedding(table)?
        })
    }

    fn rope(&self, spec: &RopeSpec, max_positions: usize) -> Result<RopeTable> {
        Ok(RopeTable::new(spec, max_positions))
    }

    fn moe(&self, m: MoeMatrices, spec: MoeSpec) -> Result<moe::Moe> {
        moe::Moe::new(m, spec, self.format)
    }

    fn moe_bytes(&self, m: &moe::Moe) -> MoeBytes {
        m.bytes()
    }

    fn linear_bytes(&self, w: &Vec<Linear>) -> usize {
        w.iter().map(Linear::bytes).sum()
    }

    fn embedding_bytes(&self, e: &Embedding) -> usize {
        e.table.storage_size_in_bytes()
    }

    fn layer_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvCacheDtype,
    ) -> Result<LayerCache> {
        let shape = CacheShape {
            num_blocks,
            block_size,
            num_kv_heads: kv_heads,
            head_dim,
        };
        Ok(LayerCache::new(
            shape,
            dtype.resolve(DeviceKind::Cpu.auto_kv_dtype()),
        ))
    }

    fn state_cache(&self, slots: usize, spec: &GdnSpec) -> Result<gdn::StateCache> {
        Ok(gdn::StateCache::new(slots, spec))
    }

    fn step(
        &mut self,
        host: &crate::step::PackedStep,
        draws: Option<crate::step::DeviceDraws>,
        forward: super::Forward<Self>,
    ) -> Result<()> {
        if draws.is_some() {
            bail!("the CPU backend samples on the host");
        }
        let pool = self.pool.clone();
        let _running = resident::step_running();
        pool.install(|| forward(self, &Step { host, inputs: &() }))
    }

    fn embed(
        &mut self,
        s: &Step<Self>,
        e: &Embedding,
        scale: Option<f32>,
        out: &mut Mat,
    ) -> Result<()> {
        let x = out.shape(s.host.input_ids.len(), e.hidden);
        e.rows(&s.host.input_ids, x, |row, v| *row = v)?;
        if let Some(scale) = scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    fn add_rows(&mut self, table: &Embedding, ids: &[u32], x: &mut Mat) -> Result<()> {
        if x.cols != table.hidden || ids.len() != x.rows() {
            bail!(
                "{} rows of {} for {} rows of {}",
                ids.len(),
                table.hidden,
                x.rows(),
                x.cols
            );
        }
        table.rows(ids, &mut x.data, |row, v| *row += v)
    }

    fn add_bias(&mut self, x: &mut Mat, bias: &Vec<f32>, then: Option<Pointwise>) -> Result<()> {
        if x.cols != bias.len() {
            bail!("a bias of {} for rows of {}", bias.len(), x.cols);
        }
        ops::add_bias(&mut x.data, bias, then);
        Ok(())
    }

    fn layer_norm(&mut self, x: &mut Mat, w: &Vec<f32>, b: &Vec<f32>, eps: f32) -> Result<()> {
        if x.cols != w.len() || w.len() != b.len() {
            bail!("a LayerNorm of {} for rows of {}", w.len(), x.cols);
        }
        ops::layer_norm(&mut x.data, w, b, eps);
        Ok(())
    }

    fn matmul(
        &mut self,
        input: LinearIn<Self>,
        w: &Vec<Linear>,
        out: Epilogue<Self>,
    ) -> Result<()> {
        let mut proj = std::mem::take(&mut self.proj);
        let result = match out {
            Epilogue::Store(out) | Epilogue::StoreResidual(out) => {
                self.project_into(input, w, &mut out.data)?;
                out.cols = width(w);
                Ok(())
            }
            Epilogue::AddInto(residual) => {
                self.project_into(input, w, &mut proj)?;
                add_in_place(&mut residual.data, &proj);
                Ok(())
            }
            Epilogue::AddNormedInto {
                residual,
                norm,
                eps,
            } => {
                self.project_into(input, w, &mut proj)?;
                self.normed.resize(proj.len(), 0.0);
                rms_norm(&proj, norm, eps, &mut self.normed);
                add_in_place(&mut residual.data, &self.normed);
                Ok(())
            }
            Epilogue::Gated(out, act) => {
                self.project_into(input, w, &mut proj)?;
                let inter = width(w) / 2;
                let rows = proj.len() / (2 * inter).max(1);
                gated_mul(&proj, inter, act, out.shape(rows, inter));
                Ok(())
            }
        };
        self.proj = proj;
        result
    }

    fn mixture(&mut self, x: &mut Mat, norm: &Vec<f32>, eps: f32, m: &moe::Moe) -> Result<()> {
        moe::mixture(
            m,
            &mut self.moe,
            &mut self.acts,
            &mut self.part,
            x,
            norm,
            eps,
        )
    }

    fn prepare_qkv(
        &mut self,
        s: &Step<Self>,
        qkv: &Mat,
        p: &QkvPrep<Self>,
        a: &AttentionSpec,
        cache: &mut LayerCache,
        q: &mut Mat,
    ) -> Result<()> {
        let d = a.head_dim;
        let (q_w, kv_w) = (a.num_heads * d, a.num_kv_heads * d);
        a.check_qkv_width(qkv.cols)?;
        let t = qkv.rows();
        let qd = q.shape(t, q_w);
        let (k, v) = (&mut self.k, &mut self.v);
        k.resize(t * kv_w, 0.0);
        v.resize(t * kv_w, 0.0);
        for (((r, q), k), v) in qkv
            .data
            .chunks(q_w + 2 * kv_w)
            .zip(qd.chunks_mut(q_w))
            .zip(k.chunks_mut(kv_w))
            .zip(v.chunks_mut(kv_w))
        {
            q.copy_from_slice(&r[..q_w]);
            k.copy_from_slice(&r[q_w..q_w + kv_w]);
            v.copy_from_slice(&r[q_w + kv_w..]);
            if let Some(b) = p.bias {
                let (bq, bkv) = b.split_at(q_w);
                let (bk, bv) = bkv.split_at(kv_w);
                for (x, b) in [(q, bq), (k, bk), (v, bv)] {
                    x.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
            }
        }
        if let Some(n) = p.q_norm {
            head_rms_norm(qd, n, p.eps);
        }
        if let Some(n) = p.k_norm {
            head_rms_norm(k, n, p.eps);
        }
        if let Some(rope) = p.rope {
            let positions = &s.host.positions;
            rope.apply(qd, positions, a.num_heads, d);
            rope.apply(k, positions, a.num_kv_heads, d);
        }
        cache.write(k, v, &s.host.kv[a.kv_group].slot_mapping);
        Ok(())
    }

    fn attention(
        &mut self,
        s: &Step<Self>,
        q: &Mat,
        cache: &LayerCache,
        a: &AttentionSpec,
        sinks: Option<&Vec<f32>>,
        out: &mut Mat,
    ) -> Result<()> {
        let step = s.host;
        let kv = &step.kv[a.kv_group];
        let meta = AttentionMeta {
            cu_seqlens_q: &step.cu_seqlens_q,
            seq_lens_k: &step.seq_lens_k,
            block_tables: &kv.block_tables,
            max_blocks: kv.max_blocks,
            block_size: cache.shape.block_size,
        };
        let params = AttentionParams {
            num_heads: a.num_heads,
            num_kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            scale: a.scale,
            sliding_window: a.sliding_window,
            softcap: a.softcap,
            causal: a.causal,
            sinks: sinks.map(Vec::as_slice),
        };
        let o = out.shape(q.rows(), a.num_heads * a.head_dim);
        paged_attention(&q.data, &cache.k, &cache.v, &meta, &params, o);
        Ok(())
    }

    fn gated_delta(
        &mut self,
        s: &Step<Self>,
        proj: &Mat,
        p: &GdnParams<Self>,
        _spec: &GdnSpec,
        state: &mut gdn::StateCache,
        out: &mut Mat,
    ) -> Result<()> {
        let w = gdn::Weights {
            conv: p.conv,
            a_log: p.a_log,
            dt_bias: p.dt_bias,
            norm: p.norm,
        };
        let h = s.host;
        let slots = gdn::Slots {
            state: &h.state.slots,
            restores: &h.state.restores,
            saves: &h.state.saves,
            drafts: &h.state.drafts,
        };
        gdn::gated_delta(proj, &h.cu_seqlens_q, &h.positions, &slots, &w, state, out)
    }

    fn rms_norm_rows(
        &mut self,
        x: &Mat,
        rows: &[u32],
        norm: &Vec<f32>,
        eps: f32,
        out: &mut Mat,
    ) -> Result<()> {
        let (n, cols) = (x.rows(), x.cols);
        if rows.is_empty() {
            rms_norm(&x.data, norm, eps, out.shape(n, cols));
            return Ok(());
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
            bail!("row {r} of {n}");
        }
        let dst = out.shape(rows.len(), cols);
        for (d, &r) in dst.chunks_mut(cols).zip(rows) {
            rms_norm(&x.data[r as usize * cols..][..cols], norm, eps, d);
        }
        Ok(())
    }

    fn gate_sigmoid(&mut self, x: &mut Mat, gate: &Mat) -> Result<()> {
        gdn::gate_sigmoid(x, gate)
    }

    fn logits(
        &mut self,
        s: &Step<Self>,
        x: &Mat,
        norm: &Vec<f32>,
        eps: f32,
        head: &Vec<Linear>,
        cap: Option<f32>,
    ) -> Result<()> {
        // Only the rows that need logits go through the final norm and the LM head.
        let h = x.cols;
        let rows = &s.host.logits_indices;
        let mut sel = std::mem::take(&mut self.sel);
        let dst = sel.shape(rows.len(), h);
        for (dst, &i) in dst.chunks_mut(h).zip(rows) {
            dst.copy_from_slice(&x.data[i as usize * h..][..h]);
        }
        let mut logits = std::mem::take(&mut self.logits);
        let r = self.project_into(LinearIn::RmsNorm { x: &sel, norm, eps }, head, &mut logits);
        self.sel = sel;
        r?;
        if let Some(cap) = cap {
            softcap(&mut logits, cap);
        }
        self.logits = logits;
        Ok(())
    }

    fn hidden(&mut self, s: &Step<Self>, x: &Mat, norm: Option<(&Vec<f32>, f32)>) -> Result<()> {
        let h = x.cols;
        let rows = &s.host.logits_indices;
        let out = &mut self.logits;
        out.resize(rows.len() * h, 0.0);
        for (dst, &i) in out.chunks_mut(h).zip(rows) {
            dst.copy_from_slice(&x.data[i as usize * h..][..h]);
        }
        if let Some((w, eps)) = norm {
            let sel = self.sel.shape(rows.len(), h);
            sel.copy_from_slice(out);
            rms_norm(sel, w, eps, out);
        }
        Ok(())
    }

    fn host_logits(&mut self) -> Result<&mut [f32]> {
        Ok(&mut self.logits)
    }

    fn group(&self) -> Option<&crate::parallel::Group> {
        self.group.as_ref()
    }

    fn all_reduce(&mut self, x: &mut Mat) -> Result<()> {
        match &self.group {
            Some(g) => g.tensor.all_reduce_sum(&mut x.data),
            None => bail!("an all-reduce outside a tensor-parallel group"),
        }
    }

    fn send_next(&mut self, x: &Mat) -> Result<()> {
        match &self.group {
            Some(g) if !g.pp.is_last() => g
                .world
                .send(g.world_rank(g.pp.stage + 1, g.tp.rank), &x.data),
            _ => bail!("no next pipeline stage to send to"),
        }
    }

    fn recv_prev(&mut self, x: &mut Mat, rows: usize, cols: usize) -> Result<()> {
        match &self.group {
            Some(g) if !g.pp.is_first() => {
                let from = g.world_rank(g.pp.stage - 1, g.tp.rank);
                g.world.recv(from, x.shape(rows, cols))
            }
            _ => bail!("no previous pipeline stage to receive from"),
        }
    }

    fn describe(&self) -> String {
        let split = match &self.group {
            Some(g) => format!(
                ", tensor-parallel rank {} of {}, pipeline stage {} of {}",
                g.tp.rank, g.tp.size, g.pp.stage, g.pp.stages
            ),
            None => String::new(),
        };
        format!(
            "backend cpu ({} threads, weights {:?}{split}), kernels: {}",
            self.pool.current_num_threads(),
            self.format,
            Isa::detect().name()
        )
    }
}
