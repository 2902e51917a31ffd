//! `with_pool_awake` keeps the pool's threads polling for work with spinner jobs. Rayon may start such a job on a
//! thread that is waiting inside the forward's own work (here: the forward itself asks for pending jobs, as a thread
//! waiting in a join does), and that thread cannot return to the forward until the spinner ends. Spinners that ended
//! only with the forward deadlocked it (the likely reason a sweep's CPU engine never finished its first unit on a
//! 16-core GPU machine).

use frspec::engine::cpu::tensor::{pool, with_pool_awake};
use std::time::{Duration, Instant};

#[test]
fn a_spinner_started_inside_the_forward_ends() {
    // The pool is built on first use from RAYON_NUM_THREADS; this test binary has no other test to build it first.
    // Many threads: many spinner jobs waiting to be taken when a forward starts.
    std::env::set_var("RAYON_NUM_THREADS", "32");
    assert_eq!(pool().current_num_threads(), 32);
    let watchdog_limit = Duration::from_secs(120);
    std::thread::spawn(move || {
        std::thread::sleep(watchdog_limit);
        eprintln!("with_pool_awake: no return within {watchdog_limit:?}: a spinner held the forward");
        std::process::exit(1);
    });
    let mut spinners_taken = 0;
    for _ in 0..50 {
        spinners_taken += with_pool_awake(|| {
            let (start, mut executed) = (Instant::now(), 0);
            while start.elapsed() < Duration::from_millis(2) {
                executed += usize::from(rayon::yield_now() == Some(rayon::Yield::Executed));
            }
            executed
        });
    }
    // The forwards have no work of their own: every job they ran was a spinner.
    assert!(spinners_taken > 0, "no forward took a spinner job: the test did not exercise the hazard");
}
