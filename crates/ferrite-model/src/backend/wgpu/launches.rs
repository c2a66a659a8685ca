//! The launches the trait's ops are made of: norms of rows, element-wise kernels, a
//! projection with its input mode, the logits rows, embedding rows.

use super::kernels::{self, groups_for, launch};
use super::linear::{fuses, matmul, Fused, Linear, Out};
use super::tensors::{Act, Vector};
use super::{Embedding, WgpuBackend};
use crate::backend::{LinearIn, Step};
use anyhow::{bail, Result};

impl WgpuBackend {
    /// `y = rms_norm(x[rows]) * w` (or a copy with `norm` None), stored or added into `y`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_rows(
        &mut self,
        x: &wgpu::Buffer,
        rows: usize,
        cols: usize,
        norm: Option<(&wgpu::Buffer, f32)>,
        gather: Option<(&wgpu::Buffer, u32)>,
        y: &wgpu::Buffer,
        add: bool,
    ) {
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let (w, eps) = norm.unwrap_or((&k.empty, 0.0));
        let (idx, at) = gather.unwrap_or((&k.empty, u32::MAX));
        let params = [
            cols as u32,
            eps.to_bits(),
            at,
            add as u32,
            norm.is_some() as u32,
        ];
        let groups = [rows as u32, 1, 1];
        launch(
            &gpu,
            self.pass(),
            &k.rms_norm,
            &[x, w, idx, y],
            &params,
            groups,
        );
    }

    /// An element-wise kernel over `n` elements of `y`.
    pub(super) fn pointwise(
        &mut self,
        k: &kernels::Kernel,
        a: &wgpu::Buffer,
        y: &wgpu::Buffer,
        p: [u32; 4],
    ) {
        let gpu = self.gpu.clone();
        launch(&gpu, self.pass(), k, &[a, y], &p, groups_for(p[0] as usize));
    }

    /// `input` through `w` into `y` (`[rows, w.rows]`), stored or added; with `gated` (1
    /// SiLU, 2 GELU), `act(gate) * up` of a `[gate; up]` weight (`[rows, w.rows / 2]`), which
    /// the caller has checked [`fuses`].
    pub(super) fn project(
        &mut self,
        input: &LinearIn<Self>,
        w: &Linear,
        y: YOut,
        gated: u32,
    ) -> Result<usize> {
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let (x, rows, norm) = match input {
            LinearIn::Plain(x) => (x.buf()?.clone(), x.rows, None),
            LinearIn::RmsNorm { x, norm, eps } if fuses(&k, w, x.rows, self.pick, gated != 0) => {
                (x.buf()?.clone(), x.rows, Some((&norm.buf, *eps)))
            }
            LinearIn::RmsNorm { x, norm, eps } => {
                let (rows, cols) = (x.rows, x.cols);
                let normed = std::mem::take(&mut self.normed);
                let mut normed = normed;
                let nb = normed.shape(&gpu, rows, cols)?.clone();
                self.normed = normed;
                self.norm_rows(
                    x.buf()?,
                    rows,
                    cols,
                    Some((&norm.buf, *eps)),
                    None,
                    &nb,
                    false,
                );
                (nb, rows, None)
            }
        };
        if x_of(input).cols != w.cols {
            bail!(
                "a matrix of {} columns for rows of {}",
                w.cols,
                x_of(input).cols
            );
        }
        let cols = match gated {
            0 => w.rows,
            _ => w.rows / 2,
        };
        let (y, add) = match y {
            YOut::Store(act) => (act.shape(&gpu, rows, cols)?.clone(), false),
            YOut::Add(act) => {
                if act.rows != rows || act.cols != cols {
                    bail!("adding {rows} x {cols} into {} x {}", act.rows, act.cols);
                }
                (act.buf()?.clone(), true)
            }
        };
        let out = Out {
            y: &y,
            ldy: cols,
            add,
        };
        let pick = self.pick;
        let fused = Fused { norm, gated };
        matmul(&gpu, &k, self.pass(), (&x, rows), w, (out, fused), pick);
        Ok(rows)
    }
}

impl WgpuBackend {
    /// The final norm of the logits rows into `sel`, then the LM head into `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn select_logits(
        &mut self,
        s: &Step<Self>,
        x: &Act,
        norm: &Vector,
        eps: f32,
        head: &Linear,
        sel: &mut Act,
        out: &mut Act,
    ) -> Result<()> {
        let rows = s.host.logits_indices.len();
        let sb = sel.shape(&self.gpu, rows, x.cols)?.clone();
        let gather = Some((&s.inputs.buf, s.inputs.rows));
        self.norm_rows(
            x.buf()?,
            rows,
            x.cols,
            Some((&norm.buf, eps)),
            gather,
            &sb,
            false,
        );
        self.project(&LinearIn::Plain(sel), head, YOut::Store(out), 0)?;
        Ok(())
    }

    /// Rows of `e` for `tokens` ids (at word `params[1]` of `ids`) into `out`, one launch per
    /// part of the table: each writes the rows whose ids it holds.
    pub(super) fn embed_rows(
        &mut self,
        e: &Embedding,
        ids: &wgpu::Buffer,
        tokens: usize,
        mut params: [u32; 7],
        out: &mut Act,
        add: bool,
    ) -> Result<()> {
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let y = match add {
            true => out.buf()?.clone(),
            false => out.shape(&gpu, tokens, e.table.cols)?.clone(),
        };
        for part in &e.table.parts {
            params[2] = (e.first + part.first) as u32;
            params[3] = part.rows as u32;
            params[6] = part.scales as u32;
            let buffers = [ids, &part.buf, &y];
            launch(
                &gpu,
                self.pass(),
                &k.embed[part.format as usize],
                &buffers,
                &params,
                [tokens as u32, 1, 1],
            );
        }
        Ok(())
    }
}

/// The rows a projection reads (normalized or not).
pub(super) fn x_of<'a>(input: &LinearIn<'a, WgpuBackend>) -> &'a Act {
    match input {
        LinearIn::Plain(x) => x,
        LinearIn::RmsNorm { x, .. } => x,
    }
}

/// Where [`WgpuBackend::project`] writes.
pub(super) enum YOut<'a> {
    Store(&'a mut Act),
    Add(&'a Act),
}

/// Ids past the whole vocabulary are refused here: a kernel cannot fail.
pub(super) fn check_ids(ids: &[u32], e: &Embedding) -> Result<()> {
    let vocab = e.table.rows;
    match ids.iter().find(|&&id| e.first == 0 && id as usize >= vocab) {
        Some(id) => bail!("row {id} of a table of {vocab}"),
        None => Ok(()),
    }
}

pub(super) fn embed_params(e: &Embedding, ids_at: u32, scale: f32, add: bool) -> [u32; 7] {
    [
        e.table.cols as u32,
        ids_at,
        e.first as u32,
        e.table.rows as u32,
        scale.to_bits(),
        add as u32,
        0,
    ]
}
