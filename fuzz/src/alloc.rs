//! A counting allocator for the worker: the memory an input makes the
//! reader hold, and a ceiling on it. A request past the ceiling fails, so
//! a reader that believes a header's claimed size aborts with Rust's
//! "memory allocation of N bytes failed" instead of taking the machine.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The allocator (installed by `main`).
pub struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static CEILING: AtomicUsize = AtomicUsize::new(usize::MAX);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted(layout.size(), || unsafe { System.alloc(layout) })
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted(layout.size(), || unsafe { System.alloc_zeroed(layout) })
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !reserve(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        let p = System.realloc(ptr, layout, new_size);
        if p.is_null() {
            if new_size > layout.size() {
                CURRENT.fetch_sub(new_size - layout.size(), Ordering::Relaxed);
            }
        } else if new_size < layout.size() {
            CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        p
    }
}

/// `allocate`'s block of `size` bytes, counted; null past the ceiling.
fn counted(size: usize, allocate: impl FnOnce() -> *mut u8) -> *mut u8 {
    if !reserve(size) {
        return std::ptr::null_mut();
    }
    let p = allocate();
    if p.is_null() {
        CURRENT.fetch_sub(size, Ordering::Relaxed);
    }
    p
}

/// Counts `size` more bytes held, unless that passes the ceiling.
fn reserve(size: usize) -> bool {
    let now = CURRENT.fetch_add(size, Ordering::Relaxed).saturating_add(size);
    if now > CEILING.load(Ordering::Relaxed) {
        CURRENT.fetch_sub(size, Ordering::Relaxed);
        return false;
    }
    PEAK.fetch_max(now, Ordering::Relaxed);
    true
}

/// Starts measuring one input: the peak restarts from what is held now,
/// and at most `allowance` more bytes may be held until the next call.
/// Returns what is held now (the baseline).
pub fn start_input(allowance: usize) -> usize {
    let now = CURRENT.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    CEILING.store(now.saturating_add(allowance), Ordering::Relaxed);
    now
}

/// The most bytes held since [`start_input`], above its baseline.
pub fn peak_above(baseline: usize) -> usize {
    PEAK.load(Ordering::Relaxed).saturating_sub(baseline)
}

/// Lifts the ceiling (between inputs).
pub fn no_ceiling() {
    CEILING.store(usize::MAX, Ordering::Relaxed);
}
