//! PyTorch's `torch.save` files (`.pt`, `pytorch_model.bin`: a zip holding `data.pkl` and one entry per storage)
//! read as data, within bounds set by the file's own size.
//!
//! frspec reads these itself rather than through `candle_core::pickle` (which never runs code either) because that
//! reader trusts the file: a memo entry is copied on every get (a 300-byte pickle can ask for 2^40 objects), a string
//! or tensor is allocated at the length the file declares before a byte of it is read, argument tuples are indexed
//! unchecked (panics), and deep nesting overflows the stack when the value is dropped. No maintained crate reads torch
//! pickles with bounds. The values are candle's `Object`, so what candle understands, frspec does too.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::pickle::Object;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The values a pickle builds may take this much memory per byte of pickle (plus `BUILD_BASE`): generous for
/// torch's pickles (a memo get of a class name is ~100 bytes of values for 2 bytes of pickle), small enough that no
/// pickle can exhaust memory.
const BUILD_PER_BYTE: usize = 256;
const BUILD_BASE: usize = 1 << 20;
/// Nested deeper than this, dropping or printing a value would overflow the stack; torch nests a handful of levels.
const MAX_DEPTH: usize = 256;
/// Deflate never shrinks data more than this (zlib's technical limit is 1032:1).
const DEFLATE_MAX_RATIO: u64 = 1032;

/// An opened torch file: the pickle's root value, and the archive its storages live in.
pub struct TorchFile {
    path: PathBuf,
    zip: zip::ZipArchive<std::fs::File>,
    /// The file's length: no entry can hold more.
    len: u64,
    /// The archive's folder (`archive/`, or the name torch gave it): storages are `{folder}data/{key}`.
    folder: String,
    pub root: Object,
}

impl TorchFile {
    pub fn open(path: &Path) -> Result<TorchFile> {
        let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let len = file.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
        let mut zip = zip::ZipArchive::new(file).map_err(|e| anyhow!("{} is not a torch zip file: {e}", path.display()))?;
        let pkl = zip
            .file_names()
            .filter_map(|n| n.ok().map(|n| n.to_string()))
            .filter(|n| n.ends_with("data.pkl"))
            .min_by_key(|n| n.len())
            .ok_or_else(|| anyhow!("{}: no data.pkl inside", path.display()))?;
        let bytes = entry_bytes(&mut zip, len, &pkl).with_context(|| path.display().to_string())?;
        let root = unpickle(&bytes).map_err(|e| anyhow!("{}: bad pickle: {e:#}", path.display()))?;
        let folder = pkl.trim_end_matches("data.pkl").to_string();
        Ok(TorchFile { path: path.to_path_buf(), zip, len, folder, root })
    }

    /// The tensor `value` rebuilds (`torch._utils._rebuild_tensor_v2`, possibly inside `_rebuild_parameter`), or None
    /// when it is something else.
    pub fn tensor(&mut self, value: &Object) -> Result<Option<Tensor>> {
        let Some(view) = TensorView::of(value).with_context(|| self.path.display().to_string())? else { return Ok(None) };
        let name = format!("{}data/{}", self.folder, view.key);
        let bytes = entry_bytes(&mut self.zip, self.len, &name).with_context(|| format!("{}: tensor storage", self.path.display()))?;
        view.read(&bytes).map(Some).with_context(|| format!("{}: tensor storage {name}", self.path.display()))
    }

    /// Every named tensor of a state dict (the root dict, as `torch.save(model.state_dict())` writes it).
    pub fn state_dict(mut self) -> Result<HashMap<String, Tensor>> {
        let Object::Dict(entries) = std::mem::replace(&mut self.root, Object::None) else {
            bail!("{}: expected a state dict (a dict of named tensors) at the root", self.path.display());
        };
        let mut tensors = HashMap::new();
        for (key, value) in &entries {
            let Object::Unicode(name) = key else { continue };
            if let Some(t) = self.tensor(value).with_context(|| format!("tensor {name}"))? {
                tensors.insert(name.clone(), t);
            }
        }
        Ok(tensors)
    }
}

/// One archive entry's bytes, refused when it claims more than the archive can hold: a stored entry is no larger
/// than the file, a deflated one at most `DEFLATE_MAX_RATIO` times its packed size.
fn entry_bytes(zip: &mut zip::ZipArchive<std::fs::File>, archive_len: u64, name: &str) -> Result<Vec<u8>> {
    let entry = zip.by_name(name).map_err(|e| anyhow!("entry {name}: {e}"))?;
    let (declared, packed) = (entry.size(), entry.compressed_size());
    let most = match entry.compression() {
        zip::CompressionMethod::Stored => packed,
        _ => packed.saturating_mul(DEFLATE_MAX_RATIO),
    };
    if packed > archive_len || declared > most {
        bail!("entry {name} claims {declared} bytes ({packed} packed) in an archive of {archive_len}");
    }
    let mut bytes = Vec::with_capacity(declared as usize);
    entry.take(declared).read_to_end(&mut bytes).map_err(|e| anyhow!("entry {name}: {e}"))?;
    if bytes.len() as u64 != declared {
        bail!("entry {name} holds {} bytes, its header says {declared}", bytes.len());
    }
    Ok(bytes)
}

/// Where a tensor's elements are: `(storage, offset, size, stride, ...)` of `_rebuild_tensor_v2`, offset and
/// strides in elements.
struct TensorView {
    key: String,
    dtype: DType,
    storage_len: usize,
    offset: usize,
    dims: Vec<usize>,
    strides: Vec<usize>,
}

impl TensorView {
    fn of(value: &Object) -> Result<Option<TensorView>> {
        let Object::Reduce { callable, args } = value else { return Ok(None) };
        match (class(callable), &**args) {
            (Some(("torch._utils", "_rebuild_parameter")), Object::Tuple(args)) => match args.first() {
                Some(inner) => TensorView::of(inner),
                None => bail!("_rebuild_parameter without arguments"),
            },
            (Some(("torch._utils", "_rebuild_tensor_v2")), Object::Tuple(args)) => {
                let [storage, offset, size, stride, ..] = args.as_slice() else {
                    bail!("_rebuild_tensor_v2 takes (storage, offset, size, stride, ...), got {} arguments", args.len());
                };
                let Object::PersistentLoad(storage) = storage else { bail!("a tensor's storage is not a persistent id") };
                let Object::Tuple(storage) = &**storage else { bail!("a tensor's storage id is not a tuple") };
                let [_, class_of, Object::Unicode(key), _, numel, ..] = storage.as_slice() else {
                    bail!("a tensor's storage id is not (\"storage\", class, key, location, size)");
                };
                let dtype = match class(class_of).map(|(_, c)| c) {
                    Some("FloatStorage") => DType::F32,
                    Some("DoubleStorage") => DType::F64,
                    Some("HalfStorage") => DType::F16,
                    Some("BFloat16Storage") => DType::BF16,
                    Some("ByteStorage") | Some("BoolStorage") => DType::U8,
                    Some("ShortStorage") => DType::I16,
                    Some("IntStorage") => DType::I32,
                    Some("LongStorage") => DType::I64,
                    _ => bail!("unsupported tensor storage {class_of:?}"),
                };
                crate::loading::RepoPath::new(key).context("a tensor's storage key")?;
                Ok(Some(TensorView {
                    key: key.clone(),
                    dtype,
                    storage_len: count(numel).context("storage size")?,
                    offset: count(offset).context("storage offset")?,
                    dims: counts(size).context("tensor size")?,
                    strides: counts(stride).context("tensor stride")?,
                }))
            }
            _ => Ok(None),
        }
    }

    /// The tensor, from its storage's bytes: every element it names must lie inside the storage, and it may not name
    /// more elements than the storage holds (a broadcast view would turn a few bytes into gigabytes).
    fn read(&self, storage: &[u8]) -> Result<Tensor> {
        let width = self.dtype.size_in_bytes();
        if storage.len() / width < self.storage_len {
            bail!("holds {} bytes, fewer than its {} elements of {:?}", storage.len(), self.storage_len, self.dtype);
        }
        if self.dims.len() != self.strides.len() {
            bail!("shape {:?} and strides {:?} differ in rank", self.dims, self.strides);
        }
        let n = self.dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| anyhow!("shape {:?} overflows", self.dims))?;
        if n > self.storage_len {
            bail!("shape {:?} names {n} elements, more than the storage's {}", self.dims, self.storage_len);
        }
        if n > 0 {
            let last = self.dims.iter().zip(&self.strides).try_fold(self.offset, |at, (&d, &s)| at.checked_add((d - 1).checked_mul(s)?));
            if !last.is_some_and(|last| last < self.storage_len) {
                bail!("the tensor (offset {}, shape {:?}, strides {:?}) reaches past the {} elements of its storage", self.offset, self.dims, self.strides, self.storage_len);
            }
        }
        let mut bytes = Vec::with_capacity(n * width);
        let mut index = vec![0usize; self.dims.len()];
        for _ in 0..n {
            let at = self.offset + index.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>();
            bytes.extend_from_slice(&storage[at * width..(at + 1) * width]);
            for axis in (0..index.len()).rev() {
                index[axis] += 1;
                if index[axis] < self.dims[axis] {
                    break;
                }
                index[axis] = 0;
            }
        }
        Ok(Tensor::from_raw_buffer(&bytes, self.dtype, &self.dims, &Device::Cpu)?)
    }
}

fn class(value: &Object) -> Option<(&str, &str)> {
    match value {
        Object::Class { module_name, class_name } => Some((module_name, class_name)),
        _ => None,
    }
}

fn count(value: &Object) -> Result<usize> {
    match value {
        Object::Int(i) if *i >= 0 => Ok(*i as usize),
        Object::Long(i) if *i >= 0 => usize::try_from(*i).map_err(|_| anyhow!("{i} is too large")),
        other => bail!("expected a count, found {other:?}"),
    }
}

fn counts(value: &Object) -> Result<Vec<usize>> {
    match value {
        Object::Tuple(items) => items.iter().map(count).collect(),
        other => bail!("expected a tuple of counts, found {other:?}"),
    }
}

/// A value under construction, with what it cost (bytes of values, approximately) and how deeply it nests.
#[derive(Clone)]
struct Built {
    value: Object,
    cost: usize,
    depth: usize,
}

impl Built {
    fn leaf(value: Object) -> Built {
        let text = match &value {
            Object::Unicode(s) => s.len(),
            Object::Class { module_name, class_name } => module_name.len() + class_name.len(),
            _ => 0,
        };
        Built { value, cost: std::mem::size_of::<Object>() + text, depth: 1 }
    }

    fn of(children: Vec<Built>, make: impl FnOnce(Vec<Object>) -> Object) -> Built {
        let cost = std::mem::size_of::<Object>() + children.iter().map(|c| c.cost).sum::<usize>();
        let depth = 1 + children.iter().map(|c| c.depth).max().unwrap_or(0);
        Built { value: make(children.into_iter().map(|c| c.value).collect()), cost, depth }
    }

    fn join<const N: usize>(parts: [Built; N], make: impl FnOnce([Object; N]) -> Object) -> Built {
        let cost = std::mem::size_of::<Object>() + parts.iter().map(|c| c.cost).sum::<usize>();
        let depth = 1 + parts.iter().map(|c| c.depth).max().unwrap_or(0);
        Built { value: make(parts.map(|c| c.value)), cost, depth }
    }
}

/// The pickle virtual machine for the opcodes torch.save writes (protocol 2, and the few later ones it may use),
/// building data only: GLOBAL names a class, REDUCE records a call, nothing is imported or run.
struct Machine<'a> {
    input: &'a [u8],
    at: usize,
    stack: Vec<Built>,
    marks: Vec<usize>,
    memo: HashMap<u32, Built>,
    /// What the values built so far have cost; memo gets count too, as each copies its value.
    spent: usize,
    budget: usize,
}

fn unpickle(input: &[u8]) -> Result<Object> {
    let budget = BUILD_BASE.saturating_add(input.len().saturating_mul(BUILD_PER_BYTE));
    let mut m = Machine { input, at: 0, stack: Vec::new(), marks: Vec::new(), memo: HashMap::new(), spent: 0, budget };
    loop {
        let at = m.at;
        if at == input.len() {
            bail!("the pickle ends without STOP");
        }
        let op = m.bytes(1)?[0];
        if m.step(op).with_context(|| format!("opcode 0x{op:02x} at byte {at}"))? {
            break;
        }
    }
    let root = m.pop()?;
    Ok(root.value)
}

impl<'a> Machine<'a> {
    /// Runs one opcode; true at STOP.
    fn step(&mut self, op: u8) -> Result<bool> {
        match op {
            b'.' => return Ok(true),
            0x80 => {
                self.bytes(1)?;
            }
            0x95 => {
                self.bytes(8)?;
            }
            b'c' => {
                let module_name = self.line()?;
                let class_name = self.line()?;
                self.push(Built::leaf(Object::Class { module_name, class_name }))?;
            }
            0x93 => match self.pop_array()?.map(|b| b.value) {
                [Object::Unicode(module_name), Object::Unicode(class_name)] => {
                    self.push(Built::leaf(Object::Class { module_name, class_name }))?
                }
                other => bail!("STACK_GLOBAL expects two strings, found {other:?}"),
            },
            b'K' => {
                let v = self.bytes(1)?[0];
                self.push(Built::leaf(Object::Int(v.into())))?;
            }
            b'M' => {
                let v = u16::from_le_bytes(self.array()?);
                self.push(Built::leaf(Object::Int(v.into())))?;
            }
            b'J' => {
                let v = i32::from_le_bytes(self.array()?);
                self.push(Built::leaf(Object::Int(v)))?;
            }
            0x8a => {
                let n = self.bytes(1)?[0] as usize;
                let raw = self.bytes(n)?;
                if n > 8 {
                    bail!("a {n}-byte integer does not fit 64 bits");
                }
                // Little-endian two's complement, sign-extended from its top byte.
                let fill = if raw.last().is_some_and(|b| b & 0x80 != 0) { 0xff } else { 0 };
                let mut le = [fill; 8];
                le[..n].copy_from_slice(raw);
                self.push(Built::leaf(Object::Long(i64::from_le_bytes(le))))?;
            }
            b'G' => {
                let v = f64::from_be_bytes(self.array()?);
                self.push(Built::leaf(Object::Float(v)))?;
            }
            b'X' => {
                let len = u32::from_le_bytes(self.array()?) as usize;
                let text = self.utf8(len)?;
                self.push(Built::leaf(Object::Unicode(text)))?;
            }
            0x8c => {
                let len = self.bytes(1)?[0] as usize;
                let text = self.utf8(len)?;
                self.push(Built::leaf(Object::Unicode(text)))?;
            }
            b'N' => self.push(Built::leaf(Object::None))?,
            0x88 => self.push(Built::leaf(Object::Bool(true)))?,
            0x89 => self.push(Built::leaf(Object::Bool(false)))?,
            b')' => self.push(Built::of(vec![], Object::Tuple))?,
            b']' => self.push(Built::of(vec![], Object::List))?,
            b'}' => self.push(Built::of(vec![], |_| Object::Dict(vec![])))?,
            b'(' => self.marks.push(self.stack.len()),
            b't' => {
                let items = self.pop_to_mark()?;
                self.push(Built::of(items, Object::Tuple))?;
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let items = self.pop_n(n)?;
                self.push(Built::of(items, Object::Tuple))?;
            }
            b'd' => {
                let items = self.pop_to_mark()?;
                let dict = Built::of(vec![], |_| Object::Dict(vec![]));
                self.push(dict)?;
                self.set_items(items)?;
            }
            b'a' => {
                let item = self.pop()?;
                self.extend_list(vec![item])?;
            }
            b'e' => {
                let items = self.pop_to_mark()?;
                self.extend_list(items)?;
            }
            b's' => {
                let items = self.pop_n(2)?;
                self.set_items(items)?;
            }
            b'u' => {
                let items = self.pop_to_mark()?;
                self.set_items(items)?;
            }
            b'Q' => {
                let id = self.pop_array()?;
                self.push(Built::join(id, |[id]| Object::PersistentLoad(Box::new(id))))?;
            }
            b'R' | 0x81 => {
                let [callable, args] = self.pop_array()?;
                let reduced = match &callable.value {
                    Object::Class { module_name, class_name }
                        if module_name == "collections" && (class_name == "OrderedDict" || class_name == "defaultdict") =>
                    {
                        Built::of(vec![], |_| Object::Dict(vec![]))
                    }
                    _ => Built::join([callable, args], |[c, a]| Object::Reduce { callable: Box::new(c), args: Box::new(a) }),
                };
                self.push(reduced)?;
            }
            b'b' => {
                let [mut target, state] = self.pop_array()?;
                let built = match (&mut target.value, state.value) {
                    (Object::Dict(into), Object::Dict(from)) => {
                        into.extend(from);
                        target.cost += state.cost;
                        target.depth = target.depth.max(state.depth);
                        target
                    }
                    (_, args) => {
                        let state = Built { value: args, ..state };
                        Built::join([target, state], |[c, a]| Object::Build { callable: Box::new(c), args: Box::new(a) })
                    }
                };
                self.push(built)?;
            }
            b'q' => {
                let id = self.bytes(1)?[0].into();
                self.memo_put(id)?;
            }
            b'r' => {
                let id = u32::from_le_bytes(self.array()?);
                self.memo_put(id)?;
            }
            0x94 => {
                let id = self.memo.len() as u32;
                self.memo_put(id)?;
            }
            b'h' => {
                let id = self.bytes(1)?[0].into();
                self.memo_get(id)?;
            }
            b'j' => {
                let id = u32::from_le_bytes(self.array()?);
                self.memo_get(id)?;
            }
            other => bail!("unsupported pickle opcode 0x{other:02x}"),
        }
        Ok(false)
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.input.len());
        let end = end.ok_or_else(|| anyhow!("the pickle ends {} bytes into a {n}-byte field", self.input.len() - self.at))?;
        let slice = &self.input[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.bytes(N)?.try_into().expect("bytes gives N bytes"))
    }

    fn utf8(&mut self, len: usize) -> Result<String> {
        let raw = self.bytes(len)?;
        String::from_utf8(raw.to_vec()).map_err(|_| anyhow!("a string that is not UTF-8"))
    }

    fn line(&mut self) -> Result<String> {
        let rest = &self.input[self.at..];
        let end = rest.iter().position(|&b| b == b'\n').ok_or_else(|| anyhow!("a GLOBAL name without its newline"))?;
        let text = std::str::from_utf8(&rest[..end]).map_err(|_| anyhow!("a GLOBAL name that is not UTF-8"))?.to_string();
        self.at += end + 1;
        Ok(text)
    }

    fn charge(&mut self, cost: usize) -> Result<()> {
        self.spent = self.spent.saturating_add(cost);
        if self.spent > self.budget {
            bail!("the pickle builds more than {} bytes of values from {} bytes (a memo bomb?)", self.budget, self.input.len());
        }
        Ok(())
    }

    fn push(&mut self, built: Built) -> Result<()> {
        if built.depth > MAX_DEPTH {
            bail!("values nested more than {MAX_DEPTH} deep");
        }
        self.charge(std::mem::size_of::<Object>())?;
        self.stack.push(built);
        Ok(())
    }

    fn pop(&mut self) -> Result<Built> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            bail!("a value was expected, found a MARK");
        }
        self.stack.pop().ok_or_else(|| anyhow!("the stack is empty"))
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Built>> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() < floor + n {
            bail!("{n} values expected on the stack, found {}", self.stack.len() - floor);
        }
        Ok(self.stack.split_off(self.stack.len() - n))
    }

    fn pop_array<const N: usize>(&mut self) -> Result<[Built; N]> {
        self.pop_n(N)?.try_into().map_err(|_| anyhow!("{N} values expected"))
    }

    fn pop_to_mark(&mut self) -> Result<Vec<Built>> {
        let mark = self.marks.pop().ok_or_else(|| anyhow!("no MARK to pop to"))?;
        Ok(self.stack.split_off(mark))
    }

    fn top(&mut self) -> Result<&mut Built> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            bail!("a value was expected, found a MARK");
        }
        self.stack.last_mut().ok_or_else(|| anyhow!("the stack is empty"))
    }

    fn extend_list(&mut self, items: Vec<Built>) -> Result<()> {
        let top = self.top()?;
        let Object::List(list) = &mut top.value else { bail!("APPEND to something that is not a list") };
        for item in items {
            top.cost += item.cost;
            top.depth = top.depth.max(item.depth + 1);
            list.push(item.value);
        }
        self.check_top()
    }

    fn set_items(&mut self, items: Vec<Built>) -> Result<()> {
        if items.len() % 2 != 0 {
            bail!("SETITEMS with an odd number of values");
        }
        let top = self.top()?;
        let Object::Dict(dict) = &mut top.value else { bail!("SETITEM on something that is not a dict") };
        let mut items = items.into_iter();
        while let (Some(key), Some(value)) = (items.next(), items.next()) {
            top.cost += key.cost + value.cost;
            top.depth = top.depth.max(key.depth.max(value.depth) + 1);
            dict.push((key.value, value.value));
        }
        self.check_top()
    }

    fn check_top(&mut self) -> Result<()> {
        if self.top()?.depth > MAX_DEPTH {
            bail!("values nested more than {MAX_DEPTH} deep");
        }
        Ok(())
    }

    /// The memo keeps a copy (what candle does; torch's pickles never change a value after memoizing it and then
    /// read it back), paid for like any other value.
    fn memo_put(&mut self, id: u32) -> Result<()> {
        let top = self.top()?.clone();
        self.charge(top.cost)?;
        self.memo.insert(id, top);
        Ok(())
    }

    fn memo_get(&mut self, id: u32) -> Result<()> {
        let cost = self.memo.get(&id).ok_or_else(|| anyhow!("memo entry {id} was never stored"))?.cost;
        self.charge(cost)?;
        let copy = self.memo[&id].clone();
        self.push(copy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list memoized, then a list of two gets of it memoized, `levels` times: 2^levels elements if gets copy.
    fn memo_bomb(levels: u32) -> Vec<u8> {
        let mut p = vec![0x80, 2, b']', b'q', 0];
        for i in 0..levels {
            p.extend([b']', b'(', b'h', i as u8, b'h', i as u8, b'e', b'q', i as u8 + 1]);
        }
        p.push(b'.');
        p
    }

    #[test]
    fn a_memo_bomb_is_refused_within_its_budget_and_small_pickles_read() {
        let err = unpickle(&memo_bomb(60)).unwrap_err();
        assert!(format!("{err:#}").contains("memo bomb"), "{err:#}");
        let Object::List(items) = unpickle(&memo_bomb(3)).unwrap() else { panic!("a list") };
        assert_eq!(items.len(), 2);
    }

    #[test]
    fn short_lengths_deep_nesting_and_bad_arguments_are_errors() {
        let cases: [(&[u8], &str); 7] = [
            (&[b'X', 0xf0, 0xff, 0xff, 0xff, b'.'], "ends"),
            (&[b'N', b'N', b'N'], "without STOP"),
            (&[0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, b'.'], "does not fit"),
            (&[b'(', b't', b'R', b'.'], "2 values expected"),
            (&[b'h', 7, b'.'], "never stored"),
            (&[b'c', b'o', b's'], "newline"),
            (&[b'N', b's', b'.'], "2 values expected"),
        ];
        for (pickle, expected) in cases {
            let err = format!("{:#}", unpickle(pickle).unwrap_err());
            assert!(err.contains(expected), "{pickle:?}: {err}");
        }
        let mut deep = vec![b'N'];
        deep.extend(std::iter::repeat_n(0x85, 100_000));
        deep.push(b'.');
        assert!(format!("{:#}", unpickle(&deep).unwrap_err()).contains("nested more than"));
        let empty_args = [&b"ctorch._utils\n_rebuild_tensor_v2\n)R."[..]].concat();
        let err = TensorView::of(&unpickle(&empty_args).unwrap()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("got 0 arguments"), "{err}");
    }

    #[test]
    fn long_integers_are_sign_extended() {
        assert_eq!(unpickle(&[0x8a, 2, 0xff, 0x7f, b'.']).unwrap(), Object::Long(0x7fff));
        assert_eq!(unpickle(&[0x8a, 1, 0xff, b'.']).unwrap(), Object::Long(-1));
        assert_eq!(unpickle(&[0x8a, 0, b'.']).unwrap(), Object::Long(0));
    }
}
