//! One sweep split across machines: shard I of N runs a fixed part of the plan's units, the same part on every
//! machine for the same settings, so a job array needs no coordination and `frspec merge` can check coverage.

use super::{Plan, UnitKey};
use anyhow::{anyhow, bail, Result};

/// Shard `index` of `count` (0-based, as job arrays number their tasks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// `I/N`, or `slurm` for the task of a Slurm job array this process runs as.
    pub fn parse(text: &str) -> Result<Shard> {
        if text == "slurm" {
            return Shard::from_slurm(|name| std::env::var(name).ok());
        }
        let parsed = text.split_once('/').and_then(|(i, n)| Some((i.trim().parse().ok()?, n.trim().parse().ok()?)));
        let Some((index, count)) = parsed else {
            bail!("--shard {text:?}: expected I/N (shard I of N, counting from 0) or slurm");
        };
        Shard::new(index, count)
    }

    pub fn new(index: usize, count: usize) -> Result<Shard> {
        if count == 0 || index >= count {
            bail!("shard {index}/{count}: a sweep has shards 0/N to (N-1)/N, N at least 1");
        }
        Ok(Shard { index, count })
    }

    /// Slurm numbers an array's tasks from `--array`'s first id (which need not be 0) and says how many there are.
    fn from_slurm(var: impl Fn(&str) -> Option<String>) -> Result<Shard> {
        let number = |name: &str| -> Result<usize> {
            let text = var(name).ok_or_else(|| anyhow!("--shard slurm: {name} is not set; run it as a task of a Slurm job array (sbatch --array)"))?;
            text.parse().map_err(|_| anyhow!("--shard slurm: {name} is {text:?}, not a number"))
        };
        let (id, min, count) = (number("SLURM_ARRAY_TASK_ID")?, number("SLURM_ARRAY_TASK_MIN")?, number("SLURM_ARRAY_TASK_COUNT")?);
        let index = id.checked_sub(min).ok_or_else(|| anyhow!("--shard slurm: task {id} is below the array's first task {min}"))?;
        Shard::new(index, count).map_err(|e| anyhow!("--shard slurm (an array with gaps in its ids?): {e}"))
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// What a unit costs, in turns the target decodes: a sampled unit decodes every ratio's turns; a greedy unit decodes
/// its turns once and drafts along every ratio's head (the T = 0 fast path), which costs little beside it.
fn cost(plan: &Plan, key: &UnitKey) -> usize {
    match key.repeat {
        Some(_) => plan.ratios.len() * plan.turns,
        None => plan.turns,
    }
}

/// The shard of each of `units`: the most expensive units first (plan order among equals), each to the shard with
/// the least cost so far (the lowest index among equals). Depends only on the plan, so every machine agrees.
pub fn assign(plan: &Plan, units: &[UnitKey], count: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..units.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(cost(plan, &units[i])));
    let mut load = vec![0usize; count];
    let mut shard_of = vec![0; units.len()];
    for i in order {
        let lightest = (0..count).min_by_key(|&s| (load[s], s)).expect("at least one shard");
        load[lightest] += cost(plan, &units[i]);
        shard_of[i] = lightest;
    }
    shard_of
}

/// The units of `shard`, in plan order.
pub fn units_of(plan: &Plan, units: &[UnitKey], shard: Shard) -> Vec<UnitKey> {
    let shard_of = assign(plan, units, shard.count);
    units.iter().zip(shard_of).filter(|(_, s)| *s == shard.index).map(|(u, _)| *u).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(ratios: usize, temperatures: Vec<f32>, repeats: u32) -> Plan {
        Plan {
            ratios: (0..ratios).map(|r| r as f64 / 10.0).collect(),
            temperatures,
            top_p: 1.0,
            repeats,
            seed: 0,
            k: 4,
            turns: 2,
            max_new_tokens: 8,
            mode: crate::speculative::DraftMode::Sample,
        }
    }

    #[test]
    fn every_unit_goes_to_one_shard_the_same_way_each_time_and_the_load_is_even() {
        let p = plan(6, vec![0.0, 1.0], 5);
        let units = p.units(80);
        for count in [1, 3, 7, 500] {
            let parts: Vec<Vec<UnitKey>> = (0..count).map(|i| units_of(&p, &units, Shard::new(i, count).unwrap())).collect();
            let mut all: Vec<UnitKey> = parts.concat();
            all.sort();
            let mut expected = units.clone();
            expected.sort();
            assert_eq!(all, expected, "{count} shards cover every unit exactly once");
            assert_eq!(assign(&p, &units, count), assign(&p, &units, count));
            let loads: Vec<usize> = parts.iter().map(|part| part.iter().map(|u| cost(&p, u)).sum()).collect();
            let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
            let biggest = units.iter().map(|u| cost(&p, u)).max().unwrap();
            assert!(hi - lo <= biggest, "{count} shards: loads {lo}..{hi}");
        }
    }

    #[test]
    fn shards_parse_from_text_and_from_a_slurm_array() {
        assert_eq!(Shard::parse("2/3").unwrap(), Shard { index: 2, count: 3 });
        for bad in ["3/3", "0/0", "1", "a/b", "-1/3"] {
            assert!(Shard::parse(bad).is_err(), "{bad}");
        }
        let env = |vars: &'static [(&'static str, &'static str)]| move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
        let task = Shard::from_slurm(env(&[("SLURM_ARRAY_TASK_ID", "5"), ("SLURM_ARRAY_TASK_MIN", "4"), ("SLURM_ARRAY_TASK_COUNT", "3")]));
        assert_eq!(task.unwrap(), Shard { index: 1, count: 3 });
        let outside = Shard::from_slurm(env(&[])).unwrap_err().to_string();
        assert!(outside.contains("SLURM_ARRAY_TASK_ID is not set"), "{outside}");
    }
}
