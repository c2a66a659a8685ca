//! A mixture-of-experts block's expert matrices in whichever layout the file keeps them:
//! llama.cpp's stacked `blk.N.ffn_{gate,up,down}_exps` (`[experts, rows, cols]`), one tensor
//! per expert (`experts.E.gate_proj`, Mixtral's `experts.E.w1`), or transformers 5's fused
//! `experts.gate_up_proj` (`[experts, 2 * inter, hidden]`, gate rows first) and
//! `experts.down_proj`.

use super::WeightSource;
use anyhow::{anyhow, bail, Result};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

/// One of an expert's three matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPart {
    Gate,
    Up,
    Down,
}

impl ExpertPart {
    fn gguf(self) -> &'static str {
        match self {
            Self::Gate => "gate",
            Self::Up => "up",
            Self::Down => "down",
        }
    }

    /// Per-expert names: transformers' and Mixtral's.
    fn names(self) -> [&'static str; 2] {
        match self {
            Self::Gate => ["gate_proj", "w1"],
            Self::Up => ["up_proj", "w3"],
            Self::Down => ["down_proj", "w2"],
        }
    }
}

impl WeightSource {
    /// `part` of every one of `num` experts of the block `block` (`model.layers.3.mlp`),
    /// each `[rows, cols]`.
    pub fn experts(
        &mut self,
        block: &str,
        part: ExpertPart,
        num: usize,
        [rows, cols]: [usize; 2],
    ) -> Result<Vec<QTensor>> {
        let location = self.location();
        let want = [num, rows, cols];
        if let Self::Gguf { file, .. } = self {
            let layer = block
                .strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next())
                .ok_or_else(|| anyhow!("no layer in `{block}`"))?;
            let name = format!("blk.{layer}.ffn_{}_exps.weight", part.gguf());
            let t = file.tensor(&name, &Device::Cpu)?;
            if t.shape().dims() != want {
                bail!(
                    "{location}: tensor `{name}` is {:?}, the config implies {want:?}",
                    t.shape().dims()
                );
            }
            return split(&t, rows, cols);
        }
        let per_expert = part
            .names()
            .into_iter()
            .map(|n| format!("{block}.experts.0.{n}.weight"))
            .position(|n| self.has(&n));
        if let Some(i) = per_expert {
            let n = part.names()[i];
            return (0..num)
                .map(|e| self.shaped(&format!("{block}.experts.{e}.{n}.weight"), &[rows, cols]))
                .collect();
        }
        let fused = match part {
            ExpertPart::Down => format!("{block}.experts.down_proj"),
            _ => format!("{block}.experts.gate_up_proj"),
        };
        let stored = self.stored_name(&fused);
        let Self::Safetensors { files, .. } = self else {
            bail!("{location}: no tensor `{fused}` (random weights)");
        };
        let t = files
            .load(&stored, &Device::Cpu)
            .map_err(|_| {
                anyhow!(
                    "{location}: no expert weights under `{block}.experts` (per expert or fused)"
                )
            })?
            .to_dtype(candle_core::DType::F32)?;
        let fused_rows = if part == ExpertPart::Down {
            rows
        } else {
            2 * rows
        };
        if t.dims() != [num, fused_rows, cols] {
            bail!(
                "{location}: tensor `{fused}` is {:?}, the config implies {:?}",
                t.dims(),
                [num, fused_rows, cols]
            );
        }
        let start = if part == ExpertPart::Up { rows } else { 0 };
        (0..num)
            .map(|e| {
                // Rebuilt from its values: quantize reads a view's storage from its start.
                let m = t
                    .get(e)?
                    .narrow(0, start, rows)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let m = candle_core::Tensor::from_vec(m, (rows, cols), &Device::Cpu)?;
                Ok(QTensor::quantize(&m, GgmlDType::F32)?)
            })
            .collect()
    }
}

/// A stacked `[experts, rows, cols]` tensor as one `[rows, cols]` tensor per expert: each
/// expert's rows are whole blocks, so this moves bytes only.
fn split(t: &QTensor, rows: usize, cols: usize) -> Result<Vec<QTensor>> {
    let dtype = t.dtype();
    let data = t.data()?;
    let per = data.len() / t.shape().dims()[0];
    data.chunks(per)
        .map(|c| Ok(qtensor_from_ggml(dtype, c, vec![rows, cols], &Device::Cpu)?))
        .collect()
}
