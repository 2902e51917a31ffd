//! What one decode step of the candle engine allocates, counted on the CPU device (where every candle op allocates
//! its output, so the allocation count per token also counts the ops a GPU would launch). The cache is written in
//! place: the bytes a step allocates must not grow with the length of the context, as they did when the cache grew
//! by concatenation (every step copied all of it). Counts are printed for the notes (`--nocapture`).

use candle_core::{DType, Device};
use frspec::engine::candle::llama::{named_shape, Llama};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

struct Counting;

static CALLS: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size(), Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size, Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocation calls and bytes per token over `steps` greedy decode steps.
fn per_token(model: &Llama, cache: &mut frspec::engine::candle::llama::Cache, steps: usize) -> (f64, f64) {
    let mut next = 1;
    let (calls, bytes) = (CALLS.load(Relaxed), BYTES.load(Relaxed));
    for _ in 0..steps {
        next = model.greedy_next(&[next], cache).unwrap();
    }
    ((CALLS.load(Relaxed) - calls) as f64 / steps as f64, (BYTES.load(Relaxed) - bytes) as f64 / steps as f64)
}

#[test]
fn decode_allocations_do_not_grow_with_the_context() {
    let mut shape = named_shape("smollm2-135m").unwrap();
    (shape.layers, shape.vocab) = (4, 512);
    let model = Llama::random(&shape, &Device::Cpu, DType::F32).unwrap();
    let mut cache = model.new_cache();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 512) as u32).collect();
    model.greedy_next(&prompt, &mut cache).unwrap();
    let (steps, gap) = (16, 560);
    let short = per_token(&model, &mut cache, steps);
    let filler: Vec<u32> = (0..gap).map(|i| (i * 11 % 512) as u32).collect();
    model.greedy_next(&filler, &mut cache).unwrap();
    let long = per_token(&model, &mut cache, steps);
    println!("per decode token at {} and {} positions: {:.0} and {:.0} allocations, {:.0} and {:.0} bytes", 40 + steps, 40 + steps + gap + steps, short.0, long.0, short.1, long.1);
    // Copying every layer's keys and values would add this much per token over the gap; scores grow by far less.
    let cache_growth = (shape.layers * 2 * shape.kv_heads * shape.head_dim * (gap + steps) * 4) as f64;
    assert!(long.1 - short.1 < 0.1 * cache_growth, "a step allocates {:.0} more bytes after {gap} more positions (a cache copy would add {cache_growth:.0})", long.1 - short.1);
}
