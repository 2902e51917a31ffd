//! The candle engine: the target and the drafts as candle tensors on any device (CPU or CUDA) in f32, f16 or bf16,
//! behind the speculative core's traits. Features stay on the device; only the logits rows the loop asks for and a
//! draft head's logits come back to the host. The CPU engine stays the reference (exact f32 activations, quantized
//! weights, bit-exact blocks); this one trades that for what a GPU runs fast, and is checked against it.

pub mod draft;
pub mod kernels;
pub mod llama;

use crate::speculative::{Batch, Block, Draft, Feed, HeadRows, Positions, TargetModel};
use anyhow::{bail, Context as _, Result};
use candle_core::{DType, Device, Tensor};
use llama::{Cache, Llama, Rows};

/// `cpu`, `cuda` or `cuda:N`.
pub fn device(name: &str) -> Result<Device> {
    let Some(ordinal) = cuda_ordinal(name)? else {
        return Ok(Device::Cpu);
    };
    // candle's CUDA errors carry a backtrace in their text; its first line says what failed.
    let device = Device::new_cuda(ordinal).map_err(|e| anyhow::anyhow!("--device {name}: no usable GPU: {}", e.to_string().lines().next().unwrap_or_default()))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = &device {
        // SAFETY: frspec drives a device from one thread, so all its work runs on one stream, whose order alone keeps
        // every use of a tensor before its free. cudarc's per-tensor events (a wait and a record for each operand of
        // every launch) protect uses across streams, which never happen here, and cost host time on every kernel of
        // a decode step.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(device)
}

/// The GPU index `name` asks for (None for `cpu`), checked against this build without opening the device.
pub fn cuda_ordinal(name: &str) -> Result<Option<usize>> {
    if name == "cpu" {
        return Ok(None);
    }
    let Some(rest) = name.strip_prefix("cuda") else {
        bail!("--device {name}: expected cpu, cuda or cuda:N");
    };
    let ordinal = match rest {
        "" => 0,
        _ => rest.strip_prefix(':').and_then(|n| n.parse().ok()).with_context(|| format!("--device {name}: expected cuda:N with N a GPU index"))?,
    };
    if !candle_core::utils::cuda_is_available() {
        bail!("--device {name}: this frspec was built without CUDA; build it with `--features cuda` (README, GPU)");
    }
    Ok(Some(ordinal))
}

/// Whether this build can use a GPU here (CUDA compiled in and device 0 usable).
pub fn gpu_present() -> bool {
    candle_core::utils::cuda_is_available() && Device::new_cuda(0).is_ok()
}

/// `f32`, `f16` or `bf16`.
pub fn dtype(name: &str) -> Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "f16" => Ok(DType::F16),
        "bf16" => Ok(DType::BF16),
        other => bail!("--dtype {other}: expected f32, f16 or bf16"),
    }
}

/// One sequence's captured features on the device: post-norm hidden states `[n, hidden]` and the inputs of the
/// captured layers side by side per position `[n, layers · hidden]`, each written in place into a growing buffer.
pub struct DeviceFeatures {
    hidden: Rows,
    layers: Rows,
    capture: Vec<usize>,
    len: usize,
}

impl DeviceFeatures {
    fn append(&mut self, hidden: Tensor, captured: Vec<Tensor>) -> Result<()> {
        self.hidden.write(self.len, &hidden)?;
        if !captured.is_empty() {
            self.layers.write(self.len, &Tensor::cat(&captured, 1)?)?;
        }
        self.len += hidden.dim(0)?;
        Ok(())
    }

    fn rows(&self, t: &Rows, start: usize, n: usize, what: &str) -> Result<Tensor> {
        if start + n > self.len {
            bail!("{what} of positions {start}..{} asked, {} captured", start + n, self.len);
        }
        t.view(start, n).with_context(|| format!("no {what} captured"))
    }

    /// Post-norm hidden states of positions `start..start + n`.
    pub fn hidden_rows(&self, start: usize, n: usize) -> Result<Tensor> {
        self.rows(&self.hidden, start, n, "hidden states")
    }

    /// Captured layer inputs of positions `start..start + n`, `[n, layers · hidden]`.
    pub fn layer_rows(&self, start: usize, n: usize) -> Result<Tensor> {
        self.rows(&self.layers, start, n, "layer inputs")
    }
}

impl Positions for DeviceFeatures {
    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        // Later appends write over the forgotten rows.
        self.len = self.len.min(len);
        Ok(())
    }
}

impl Positions for Cache {
    fn len(&self) -> usize {
        Cache::len(self)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        Cache::truncate(self, len);
        Ok(())
    }
}

/// An LM head's rows `[rows, hidden]` on the device. A selection of rows is padded with zero rows to a multiple of
/// 128: cuBLAS runs some row counts several times slower than the next multiple (measured on an H200: 12,826 rows 3×
/// slower than 12,800 or 12,928 at batch 1024). The padding's logits are cut off before they reach the host, so
/// padded rows are never proposed.
#[derive(Clone)]
pub struct DeviceHead {
    matrix: Tensor,
    rows: usize,
}

/// Kept head rows are padded to a multiple of this.
pub const HEAD_ROW_MULTIPLE: usize = 128;

impl DeviceHead {
    /// All rows of `matrix`, as they are.
    pub fn new(matrix: Tensor) -> DeviceHead {
        DeviceHead { rows: matrix.dims()[0], matrix }
    }

    /// Logits `[1, rows]` of a hidden row, on the device (the padding's cut off).
    fn product(&self, row: &Tensor) -> Result<Tensor> {
        Ok(kernels::product(row, &self.matrix)?.narrow(1, 0, self.rows)?)
    }

    /// The rows stored on the device, padding included.
    pub fn stored_rows(&self) -> usize {
        self.matrix.dims()[0]
    }
}

impl HeadRows for DeviceHead {
    /// `[1, hidden]`.
    type Row = Tensor;
    type Scratch = ();

    fn rows(&self) -> usize {
        self.rows
    }

    fn select_rows(&self, rows: &[u32]) -> Result<DeviceHead> {
        let picked = self.matrix.index_select(&Tensor::from_slice(rows, rows.len(), self.matrix.device())?, 0)?;
        let padding = rows.len().next_multiple_of(HEAD_ROW_MULTIPLE) - rows.len();
        let matrix = match padding {
            0 => picked,
            _ => Tensor::cat(&[&picked, &Tensor::zeros((padding, picked.dim(1)?), picked.dtype(), picked.device())?], 0)?,
        };
        Ok(DeviceHead { matrix, rows: rows.len() })
    }

    fn logits(&self, row: &Tensor, out: &mut Vec<f32>, _: &mut ()) -> Result<()> {
        *out = self.product(row)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(())
    }

    /// Found on the device: one index comes back instead of a vocabulary of logits. Exact ties (rare in f32, less
    /// so in bf16) may go to another of the tied rows than the host's lowest index.
    fn argmax(&self, row: &Tensor, _: &mut Vec<f32>, _: &mut ()) -> Result<usize> {
        Ok(self.product(row)?.argmax(candle_core::D::Minus1)?.flatten_all()?.to_vec1::<u32>()?[0] as usize)
    }

    /// One product `[rows, hidden] · headᵀ` (the head read once), one copy to the host.
    fn logits_many(&self, rows: &[&Tensor], out: &mut [&mut Vec<f32>], _: &mut ()) -> Result<()> {
        let logits = self.product(&Tensor::cat(rows, 0)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (out, logits) in out.iter_mut().zip(logits) {
            **out = logits;
        }
        Ok(())
    }

    /// One product and one argmax on the device for every row; only the indices come back.
    fn argmax_many(&self, rows: &[&Tensor], _: &mut [&mut Vec<f32>], _: &mut (), indices: &mut Vec<usize>) -> Result<()> {
        let found = self.product(&Tensor::cat(rows, 0)?)?.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?;
        indices.clear();
        indices.extend(found.into_iter().map(|i| i as usize));
        Ok(())
    }

    fn probe(&self) -> Result<Tensor> {
        Ok(Tensor::full(0.5f32, (1, self.matrix.dims()[1]), self.matrix.device())?.to_dtype(self.matrix.dtype())?)
    }
}

impl TargetModel for Llama {
    type Cache = Cache;
    type Features = DeviceFeatures;
    type Head = DeviceHead;
    type DraftState = draft::DraftState;

    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn context_length(&self) -> usize {
        self.config.context_length
    }

    fn new_cache(&self) -> Cache {
        Llama::new_cache(self)
    }

    fn new_features(&self, layers: &[usize]) -> DeviceFeatures {
        DeviceFeatures { hidden: Rows::along(0), layers: Rows::along(0), capture: layers.to_vec(), len: 0 }
    }

    fn forward(&self, tokens: &[u32], cache: &mut Cache, logit_rows: &[usize], features: Option<&mut DeviceFeatures>, logits: &mut Vec<f32>) -> Result<()> {
        if let Some(&r) = logit_rows.iter().find(|&&r| r >= tokens.len()) {
            bail!("logit row {r} is outside the block of {} tokens", tokens.len());
        }
        let capture = features.as_ref().map_or(&[][..], |f| &f.capture[..]);
        let (hidden, captured) = self.forward_capturing(tokens, cache, capture)?;
        logits.clear();
        if !logit_rows.is_empty() {
            let rows: Vec<u32> = logit_rows.iter().map(|&r| r as u32).collect();
            let picked = hidden.index_select(&Tensor::from_vec(rows, logit_rows.len(), &self.device)?, 0)?;
            *logits = self.logits(&picked)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        }
        if let Some(f) = features {
            f.append(hidden, captured)?;
        }
        Ok(())
    }

    /// The EAGLE drafts on the same weights as the first one fed go through their layer in one forward
    /// (`draft::feed_together`); any other draft is fed alone.
    fn feed_drafts(&self, drafts: &mut [&mut dyn Draft<Self>], slots: &[usize], feeds: &[Feed<'_, DeviceFeatures>], rows: &mut Vec<Tensor>) -> Result<()> {
        let weights: Vec<Option<*const ()>> = slots.iter().map(|&i| drafts[i].state().map(|s| s.weights())).collect();
        let shared = weights.iter().flatten().next().copied();
        let mut fed: Vec<Option<Tensor>> = vec![None; slots.len()];
        let (mut states, mut which, mut together) = (Vec::new(), Vec::new(), Vec::new());
        for (i, draft) in drafts.iter_mut().enumerate() {
            if let Ok(j) = slots.binary_search(&i) {
                if weights[j].is_some() && weights[j] == shared {
                    states.push(draft.state().expect("has a state"));
                    which.push(j);
                    together.push(feeds[j]);
                }
            }
        }
        if !states.is_empty() {
            for (j, row) in which.into_iter().zip(draft::feed_together(self, &mut states, &together)?) {
                fed[j] = Some(row);
            }
        }
        for (j, &i) in slots.iter().enumerate() {
            if fed[j].is_none() {
                fed[j] = Some(feeds[j].to(&mut *drafts[i])?);
            }
        }
        rows.extend(fed.into_iter().map(|row| row.expect("every slot fed")));
        Ok(())
    }

    /// Every block in one pass (`Llama::forward_sequences`), every block's logit rows through the LM head in one
    /// product and one copy to the host.
    fn forward_blocks(&self, blocks: &mut [Block<'_, Self>]) -> Result<()> {
        let batch = Batch::of(blocks, |f| &f.capture)?;
        let mut caches: Vec<&mut Cache> = blocks.iter_mut().map(|b| &mut *b.cache).collect();
        let (hidden, captured) = self.forward_sequences(&batch.tokens, &mut caches, &batch.rows, &batch.capture)?;
        let logits = match batch.logit_rows.len() {
            0 => Vec::new(),
            n => {
                let rows: Vec<u32> = batch.logit_rows.iter().map(|&r| r as u32).collect();
                let picked = hidden.index_select(&Tensor::from_vec(rows, n, &self.device)?, 0)?;
                self.logits(&picked)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
            }
        };
        Batch::scatter(blocks, &logits, self.config.vocab, |f, row, n| {
            let layers = captured.iter().map(|t| t.narrow(0, row, n)).collect::<candle_core::Result<Vec<_>>>()?;
            f.append(hidden.narrow(0, row, n)?, layers)
        })
    }
}
