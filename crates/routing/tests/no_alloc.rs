//! `Router::route` allocates nothing for ordinary jobs (the engine calls it
//! for every request and on every pending-queue wake-up).
//!
//! Counting allocations needs a global allocator, which needs `unsafe impl`;
//! the exemption is confined to this test binary, and the allocator only
//! forwards to `System`.
#![allow(unsafe_code, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bare_metal, config, container, firecracker, labels};
use kici_routing::{CordonSet, HostPlatform, Router};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's arguments; the
// counter has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn route_does_not_allocate() {
    let cfg = config((0..30).map(|s| {
        let b = match s % 3 {
            0 => container(&format!("c{s}")),
            1 => bare_metal(&format!("b{s}")).mandatory(&["gpu"]),
            _ => firecracker(&format!("f{s}")),
        };
        b.set(&["linux", "gpu", &format!("x{s}")])
            .set(&["linux", "docker"])
    }));
    let router = Router::new(&cfg, &HostPlatform::new("linux", "x86_64"));
    let cases = [
        (labels(&["linux", "docker"]), labels(&[])),
        (
            labels(&["linux", "gpu", "x28"]),
            labels(&["kici:agent:firecracker"]),
        ),
        (labels(&["gpu"]), labels(&["x1", "x4", "nowhere"])),
        (labels(&[]), labels(&["docker"])),
        (labels(&["unknown"]), labels(&[])),
    ];
    let cordoned = CordonSet::from_indices([0, 4]);
    let mut found = 0;
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    for (job, exclude) in &cases {
        found += usize::from(router.route(job, exclude, &cordoned).is_some());
    }
    let allocated = ALLOCATIONS.load(Ordering::SeqCst) - before;
    assert_eq!(found, 4);
    assert_eq!(allocated, 0, "route allocated {allocated} times");
}
