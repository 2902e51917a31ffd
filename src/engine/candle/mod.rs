//! The candle engine: the target and the drafts as candle tensors on any device (CPU or CUDA) in f32, f16 or bf16,
//! behind the speculative core's traits. Features stay on the device; only the logits rows the loop asks for and a
//! draft head's logits come back to the host. The CPU engine stays the reference (exact f32 activations, quantized
//! weights, bit-exact blocks); this one trades that for what a GPU runs fast, and is checked against it.

pub mod draft;
pub mod kernels;
pub mod llama;

use crate::sampling::Sampling;
use crate::speculative::{Batch, Block, DrawRequest, Feed, HeadRows, HostLogits, LogitRows, Positions, TargetModel, Without};
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

    fn copy_prefix(&mut self, from: &DeviceFeatures, len: usize) -> Result<()> {
        if from.capture != self.capture {
            bail!("features of layers {:?} cannot start from features of layers {:?}", self.capture, from.capture);
        }
        if len > 0 {
            self.hidden.write(0, &from.hidden_rows(0, len)?)?;
            if !self.capture.is_empty() {
                self.layers.write(0, &from.layer_rows(0, len)?)?;
            }
        }
        self.len = len;
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

    fn copy_prefix(&mut self, from: &Cache, len: usize) -> Result<()> {
        Cache::copy_prefix(self, from, len)
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

/// A hidden row on the device: row `row` of `batch`, the rows one forward computed for several drafts together, so
/// that rows of one batch stack back into `[n, hidden]` with no copy per row (`stack`).
#[derive(Clone)]
pub struct DeviceRow {
    batch: Tensor,
    row: usize,
}

impl DeviceRow {
    /// Row `row` of `batch` (`[n, hidden]`).
    pub fn of(batch: Tensor, row: usize) -> DeviceRow {
        DeviceRow { batch, row }
    }

    /// The row alone, `[1, hidden]`.
    pub fn tensor(&self) -> Result<Tensor> {
        Ok(self.batch.narrow(0, self.row, 1)?)
    }
}

/// A row `[1, hidden]` of its own.
impl From<Tensor> for DeviceRow {
    fn from(row: Tensor) -> DeviceRow {
        DeviceRow { batch: row, row: 0 }
    }
}

/// `rows` as one `[n, hidden]` tensor. Rows of one batch (the slots a drafting position fed together) need no copy
/// per row: in order and consecutive they are a view of it, otherwise one gather; rows of several batches are copied
/// one by one. On a GPU at batch 64 that is one launch or none where a copy a row was 64.
pub fn stack(rows: &[&DeviceRow]) -> Result<Tensor> {
    let first = rows.first().context("no rows to stack")?;
    if rows.iter().all(|r| r.batch.id() == first.batch.id()) {
        if rows.iter().enumerate().all(|(i, r)| r.row == first.row + i) {
            return Ok(first.batch.narrow(0, first.row, rows.len())?);
        }
        let ids: Vec<u32> = rows.iter().map(|r| r.row as u32).collect();
        return Ok(first.batch.index_select(&Tensor::from_vec(ids, rows.len(), first.batch.device())?, 0)?);
    }
    let rows = rows.iter().map(|r| r.tensor()).collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&rows, 0)?)
}

impl HeadRows for DeviceHead {
    type Row = DeviceRow;
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

    fn logits(&self, row: &DeviceRow, out: &mut Vec<f32>, _: &mut ()) -> Result<()> {
        *out = self.product(&row.tensor()?)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(())
    }

    /// Found on the device: one index comes back instead of a vocabulary of logits. Exact ties (rare in f32, less
    /// so in bf16) go to the lowest index, as on the host.
    fn argmax(&self, row: &DeviceRow, _: &mut Vec<f32>, _: &mut ()) -> Result<usize> {
        Ok(kernels::argmax_rows(&self.product(&row.tensor()?)?)?.flatten_all()?.to_vec1::<u32>()?[0] as usize)
    }

    /// One product `[rows, hidden] · headᵀ` (the head read once), one copy to the host.
    fn logits_many(&self, rows: &[&DeviceRow], out: &mut [&mut Vec<f32>], _: &mut ()) -> Result<()> {
        let logits = self.product(&stack(rows)?)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (out, logits) in out.iter_mut().zip(logits) {
            **out = logits;
        }
        Ok(())
    }

    /// One product and one argmax on the device for every row; only the indices come back.
    fn argmax_many(&self, rows: &[&DeviceRow], _: &mut [&mut Vec<f32>], _: &mut (), indices: &mut Vec<usize>) -> Result<()> {
        let found = kernels::argmax_rows(&self.product(&stack(rows)?)?)?.to_vec1::<u32>()?;
        indices.clear();
        indices.extend(found.into_iter().map(|i| i as usize));
        Ok(())
    }

    fn probe(&self) -> Result<DeviceRow> {
        Ok(Tensor::full(0.5f32, (1, self.matrix.dims()[1]), self.matrix.device())?.to_dtype(self.matrix.dtype())?.into())
    }
}

impl TargetModel for Llama {
    type Cache = Cache;
    type Features = DeviceFeatures;
    type Head = DeviceHead;
    type DraftState = draft::DraftState;
    type Logits = DeviceLogits;

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

    fn feed_together(&self, states: &mut [&mut draft::DraftState], feeds: &[Feed<'_, DeviceFeatures>]) -> Result<Vec<DeviceRow>> {
        draft::feed_together(self, states, feeds)
    }

    /// Every block in one pass (`Llama::forward_sequences`), every block's logit rows through the LM head in one
    /// product; they stay on the device (`DeviceLogits`).
    fn forward_blocks(&self, blocks: &mut [Block<'_, Self>], logits: &mut DeviceLogits) -> Result<()> {
        let batch = Batch::of(blocks, |f| &f.capture)?;
        let mut caches: Vec<&mut Cache> = blocks.iter_mut().map(|b| &mut *b.cache).collect();
        let (hidden, captured) = self.forward_sequences(&batch.tokens, &mut caches, &batch.rows, &batch.capture)?;
        logits.set(match batch.logit_rows.len() {
            0 => None,
            n => {
                let rows: Vec<u32> = batch.logit_rows.iter().map(|&r| r as u32).collect();
                let picked = hidden.index_select(&Tensor::from_vec(rows, n, &self.device)?, 0)?;
                Some(self.logits(&picked)?.to_dtype(DType::F32)?)
            }
        });
        Batch::scatter(blocks, |f, row, n| {
            let layers = captured.iter().map(|t| t.narrow(0, row, n)).collect::<candle_core::Result<Vec<_>>>()?;
            f.append(hidden.narrow(0, row, n)?, layers)
        })
    }
}

/// The logit rows of a forward, `[rows, vocab]` in f32 on the device. The loop's questions are answered there:
/// softmax, the drafts' probabilities gathered, and draws by the inverse of the distribution function, found in two
/// steps (the sums of chunks of a row, then the chosen chunk), so a few numbers a row travel to the host instead of
/// the vocabulary. Top-p (a sort) and draws that leave out a draft's whole distribution (`--draft-mode sample`) are
/// answered on the host from a copy of the rows, as the CPU engine answers them.
#[derive(Default)]
pub struct DeviceLogits {
    rows: Option<Tensor>,
    host: HostLogits,
    on_host: bool,
}

/// The width of the chunks a draw first chooses among: a Llama-3 row is 501 chunks, which come back to the host as
/// sums, then the 256 values of the chosen one.
const DRAW_CHUNK: usize = 256;

impl DeviceLogits {
    fn set(&mut self, rows: Option<Tensor>) {
        (self.rows, self.on_host) = (rows, false);
    }

    fn rows(&self) -> Result<&Tensor> {
        self.rows.as_ref().context("no logit rows: the forward asked for none")
    }

    /// The rows copied to the host once a step, for what is answered there.
    fn host(&mut self) -> Result<&mut HostLogits> {
        if !self.on_host {
            let rows = self.rows()?;
            let (values, vocab) = (rows.flatten_all()?.to_vec1::<f32>()?, rows.dim(1)?);
            self.host.fill(values, vocab);
            self.on_host = true;
        }
        Ok(&mut self.host)
    }

    /// `rows`' index tensor on the device.
    fn index(&self, rows: impl Iterator<Item = usize>) -> Result<Tensor> {
        let ids: Vec<u32> = rows.map(|r| r as u32).collect();
        let n = ids.len();
        Ok(Tensor::from_vec(ids, n, self.rows()?.device())?)
    }

    /// The argmax of each of `rows`.
    fn argmax(&self, rows: impl Iterator<Item = usize>) -> Result<Vec<u32>> {
        Ok(kernels::argmax_rows(&self.rows()?.index_select(&self.index(rows)?, 0)?)?.to_vec1::<u32>()?)
    }

    /// softmax(row / temperature) of each of `rows`, `[rows, vocab]` (top-p 1).
    fn distributions(&self, sampling: Sampling, rows: impl Iterator<Item = usize>) -> Result<Tensor> {
        let picked = self.rows()?.index_select(&self.index(rows)?, 0)?;
        Ok(candle_nn::ops::softmax_last_dim(&picked.affine(1.0 / sampling.temperature as f64, 0.0)?)?)
    }
}

impl LogitRows for DeviceLogits {
    fn probabilities(&mut self, sampling: Sampling, picks: &[(usize, u32)], out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        if picks.is_empty() {
            return Ok(());
        }
        if sampling.top_p < 1.0 {
            return self.host()?.probabilities(sampling, picks, out);
        }
        if sampling.is_greedy() {
            let best = self.argmax(picks.iter().map(|p| p.0))?;
            out.extend(best.iter().zip(picks).map(|(&b, &(_, token))| if b == token { 1.0 } else { 0.0 }));
            return Ok(());
        }
        let p = self.distributions(sampling, picks.iter().map(|p| p.0))?;
        let tokens: Vec<u32> = picks.iter().map(|p| p.1).collect();
        let at = p.gather(&Tensor::from_vec(tokens, (picks.len(), 1), p.device())?, 1)?;
        out.extend(at.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    fn draw(&mut self, sampling: Sampling, requests: &[DrawRequest<'_>], out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        if requests.is_empty() {
            return Ok(());
        }
        if sampling.top_p < 1.0 || requests.iter().any(|r| matches!(r.without, Without::Distribution { .. })) {
            return self.host()?.draw(sampling, requests, out);
        }
        if sampling.is_greedy() {
            out.extend(self.argmax(requests.iter().map(|r| r.row))?);
            return Ok(());
        }
        let p = self.distributions(sampling, requests.iter().map(|r| r.row))?;
        let n = requests.len();
        // A rejected argmax draft x leaves max(0, p − 1) = 0 at x: its entry is overwritten with 0, every other row's
        // entry 0 with itself.
        let excluded: Vec<u32> = requests.iter().map(|r| if let Without::Token(x) = r.without { x } else { 0 }).collect();
        let kept: Vec<f32> = requests.iter().map(|r| if matches!(r.without, Without::Token(_)) { 0.0 } else { 1.0 }).collect();
        let at = Tensor::from_vec(excluded, (n, 1), p.device())?;
        let values = p.gather(&at, 1)?.mul(&Tensor::from_vec(kept, (n, 1), p.device())?)?;
        let residual = p.scatter(&at, &values, 1)?;
        let us: Vec<f64> = requests.iter().map(|r| r.u).collect();
        let mut drawn = inverse_cdf(&residual, &us)?;
        // Nothing left (p ≤ q everywhere): drawn from p itself, as on the host.
        let empty: Vec<usize> = (0..n).filter(|&i| drawn[i].is_none()).collect();
        if !empty.is_empty() {
            let again = inverse_cdf(&p.index_select(&self.index(empty.iter().copied())?, 0)?, &empty.iter().map(|&i| us[i]).collect::<Vec<_>>())?;
            for (&i, token) in empty.iter().zip(again) {
                drawn[i] = token;
            }
        }
        out.extend(drawn.into_iter().map(|t| t.context("a distribution with no mass")).collect::<Result<Vec<_>>>()?);
        Ok(())
    }
}

/// For each row of `probs` (`[n, vocab]`, not normalised), the first index where the running sum passes `u` times the
/// row's total (`sampling::draw_with` on the normalised row), or the last index with mass when rounding leaves u
/// above the sum; None for a row with no mass.
fn inverse_cdf(probs: &Tensor, us: &[f64]) -> Result<Vec<Option<u32>>> {
    let (n, vocab) = probs.dims2()?;
    let padding = vocab.next_multiple_of(DRAW_CHUNK) - vocab;
    let padded = if padding == 0 { probs.contiguous()? } else { probs.pad_with_zeros(1, 0, padding)? };
    let chunks = (vocab + padding) / DRAW_CHUNK;
    let sums = padded.reshape((n, chunks, DRAW_CHUNK))?.sum(2)?.to_vec2::<f32>()?;
    // Per row: the chunk where the draw lands, the mass before it and the draw's target.
    let mut found = Vec::with_capacity(n);
    for (row, &u) in sums.iter().zip(us) {
        let total: f64 = row.iter().map(|&s| s as f64).sum();
        if total <= 0.0 {
            found.push(None);
            continue;
        }
        let target = u * total;
        let (mut before, mut last) = (0f64, None);
        let mut chosen = None;
        for (c, &s) in row.iter().enumerate() {
            if s > 0.0 {
                if target < before + s as f64 {
                    chosen = Some((c, before));
                    break;
                }
                last = Some((c, before));
                before += s as f64;
            }
        }
        found.push(chosen.or(last).map(|(c, before)| (c, before, target)));
    }
    let picked: Vec<usize> = found.iter().enumerate().filter_map(|(i, f)| f.map(|(c, _, _)| i * chunks + c)).collect();
    if picked.is_empty() {
        return Ok(vec![None; n]);
    }
    let ids: Vec<u32> = picked.iter().map(|&i| i as u32).collect();
    let values = padded.reshape((n * chunks, DRAW_CHUNK))?.index_select(&Tensor::from_vec(ids, picked.len(), probs.device())?, 0)?.to_vec2::<f32>()?;
    let mut values = values.into_iter();
    Ok(found
        .into_iter()
        .map(|f| {
            let (c, mut acc, target) = f?;
            let chunk = values.next().expect("one chunk a row with mass");
            let mut last = 0;
            for (j, &p) in chunk.iter().enumerate() {
                if p > 0.0 {
                    acc += p as f64;
                    last = j;
                    if target < acc {
                        return Some((c * DRAW_CHUNK + j) as u32);
                    }
                }
            }
            Some((c * DRAW_CHUNK + last) as u32)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    /// `n` rows of logits with one likely token (7), the last row a point mass on it.
    fn logit_rows(n: usize, vocab: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut rows: Vec<f32> = (0..n * vocab).map(|i| if i % vocab == 7 { 4.0 } else { 3.0 * rng.random_range(-1.0f32..1.0) }).collect();
        rows[(n - 1) * vocab..].iter_mut().enumerate().for_each(|(i, l)| *l = if i == 7 { 1000.0 } else { 0.0 });
        rows
    }

    #[test]
    fn rows_of_one_batch_stack_without_a_copy_a_row() {
        let batch = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((4, 3)).unwrap();
        let rows: Vec<DeviceRow> = (0..4).map(|i| DeviceRow::of(batch.clone(), i)).collect();
        let storage = |t: &Tensor| {
            let (storage, _) = t.storage_and_layout();
            &*storage as *const candle_core::Storage as usize
        };
        let values = |t: Tensor| t.to_vec2::<f32>().unwrap();
        let view = stack(&[&rows[1], &rows[2]]).unwrap();
        assert_eq!(storage(&view), storage(&batch), "consecutive rows are a view of their batch");
        assert_eq!(values(view), [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]);
        let gathered = stack(&[&rows[2], &rows[0]]).unwrap();
        assert_ne!(storage(&gathered), storage(&batch));
        assert_eq!(values(gathered), [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]]);
        let own = DeviceRow::from(Tensor::new(&[[9f32, 9.0, 9.0]], &Device::Cpu).unwrap());
        assert_eq!(values(stack(&[&rows[3], &own]).unwrap()), [[9.0, 10.0, 11.0], [9.0, 9.0, 9.0]]);
    }

    #[test]
    fn rows_on_the_device_answer_as_rows_on_the_host() {
        let n = 6;
        // 1,000 ids pad the last draw chunk; 512 fill two.
        for vocab in [1000, 512] {
            let values = logit_rows(n, vocab, vocab as u64);
            let mut host = HostLogits::default();
            host.fill(values.clone(), vocab);
            let mut device = DeviceLogits::default();
            device.set(Some(Tensor::from_vec(values, (n, vocab), &Device::Cpu).unwrap()));
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
            for sampling in [Sampling::GREEDY, Sampling::new(0.7, 1.0).unwrap(), Sampling::new(1.0, 0.9).unwrap()] {
                let picks: Vec<(usize, u32)> = (0..n).map(|r| (r, rng.random_range(0..vocab as u32))).chain((0..n).map(|r| (r, 7))).collect();
                let (mut want, mut got) = (Vec::new(), Vec::new());
                host.probabilities(sampling, &picks, &mut want).unwrap();
                device.probabilities(sampling, &picks, &mut got).unwrap();
                for ((w, g), pick) in want.iter().zip(&got).zip(&picks) {
                    assert!((w - g).abs() <= 1e-6 * w.max(1e-2), "{sampling:?} {pick:?}: p {g} on the device, {w} on the host");
                }
                // Plain draws and recoveries after a rejected argmax draft (token 7, or another), u close to 1
                // included; the point-mass row leaves nothing after its token and is drawn from as it is.
                let requests: Vec<DrawRequest> = (0..300)
                    .map(|i| {
                        let without = match i % 3 {
                            0 => Without::Nothing,
                            1 => Without::Token(7),
                            _ => Without::Token(rng.random_range(0..vocab as u32)),
                        };
                        let u = if i % 50 == 0 { 1.0 - 1e-12 } else { rng.random() };
                        DrawRequest { row: (i / 3) % n, u, without }
                    })
                    .collect();
                let (mut want, mut got) = (Vec::new(), Vec::new());
                host.draw(sampling, &requests, &mut want).unwrap();
                device.draw(sampling, &requests, &mut got).unwrap();
                assert_eq!(got, want, "{sampling:?}, vocabulary {vocab}");
                assert!(want.iter().zip(&requests).any(|(&t, r)| r.row == n - 1 && matches!(r.without, Without::Token(7)) && t == 7));
            }
        }
    }
}
