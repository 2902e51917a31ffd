//! Progress of a sweep: two indicatif bars on a terminal (units with ETA; turns with tokens/s),
//! one plain line per finished unit otherwise or with `--quiet`.

use crate::sweep::Run;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Instant;

pub struct Progress {
    bars: Option<(ProgressBar, ProgressBar)>,
    units_total: usize,
    units_done: usize,
    /// Tokens the target decoded in this invocation (a greedy pass counts once, not once per ratio and repeat).
    tokens: u64,
    start: Instant,
}

impl Progress {
    /// `turns`: the records this invocation will write.
    pub fn new(plain: bool, units_total: usize, units_done: usize, turns: usize) -> Progress {
        let bars = (!plain && std::io::stderr().is_terminal()).then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let units = multi.add(ProgressBar::new(units_total as u64)).with_style(
                ProgressStyle::with_template("units {bar:30} {pos}/{len} {msg} elapsed {elapsed}, ETA {eta}").expect("a valid template"),
            );
            units.set_position(units_done as u64);
            let turns = multi.add(ProgressBar::new(turns as u64)).with_style(
                ProgressStyle::with_template("turns {bar:30} {pos}/{len} {msg}").expect("a valid template"),
            );
            (units, turns)
        });
        Progress { bars, units_total, units_done, tokens: 0, start: Instant::now() }
    }

    fn tokens_per_sec(&self) -> f64 {
        self.tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9)
    }

    pub fn unit_started(&self, label: &str) {
        if let Some((units, _)) = &self.bars {
            units.set_message(label.to_string());
        }
    }

    /// `decoded`: whether this turn's tokens were decoded for it (false for the copies a greedy pass stands for).
    pub fn turn(&mut self, run: &Run, decoded: bool) {
        if decoded {
            self.tokens += run.record.generated as u64;
        }
        if let Some((_, bar)) = &self.bars {
            bar.inc(1);
            bar.set_message(format!("{:.1} tokens/s", self.tokens_per_sec()));
        }
    }

    pub fn unit_finished(&mut self, label: &str, secs: f64) {
        self.units_done += 1;
        match &self.bars {
            Some((units, _)) => units.inc(1),
            None => eprintln!(
                "[{}/{}] {label} in {secs:.1} s ({:.1} tokens/s)",
                self.units_done,
                self.units_total,
                self.tokens_per_sec()
            ),
        }
    }

    pub fn finish(&self) {
        if let Some((units, turns)) = &self.bars {
            turns.finish_and_clear();
            units.finish();
        }
    }
}
