//! `frspec score`: teacher-forced log-probabilities along a fixed token sequence, printed or as JSON, and optionally
//! every position's logits as a float32 .npy.

use crate::loading::target::Target;
use anyhow::{Context, Result};
use std::path::Path;

/// What to score: text tokenized as written, or a JSON array of token ids.
pub enum Input<'a> {
    Text(&'a Path),
    Tokens(&'a Path),
}

pub fn run(target: &Target, input: Input, json: bool, logits_out: Option<&Path>) -> Result<()> {
    let tokens = match input {
        Input::Text(f) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("cannot read text file {}", f.display()))?;
            target.tokenizer.encode(&text)?
        }
        Input::Tokens(f) => read_token_file(f)?,
    };
    let score = crate::score::score(&target.model, &tokens)?;
    if let Some(path) = logits_out {
        write_npy(path, &score.logits, &[tokens.len() as u64, target.model.config.vocab as u64])?;
    }
    if json {
        println!("{}", serde_json::to_string(&score)?);
    } else {
        println!("{:>5} {:>8} {:>10} {:>8}", "pos", "next", "logprob", "top1");
        for p in &score.positions {
            println!("{:>5} {:>8} {:>10.4} {:>8}", p.pos, p.next_token, p.logprob, p.top1);
        }
        println!("perplexity {:.4} over {} positions", score.perplexity, score.positions.len());
    }
    Ok(())
}

fn read_token_file(path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read tokens file {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: expected a JSON array of token ids", path.display()))
}

fn write_npy(path: &Path, values: &[f32], shape: &[u64]) -> Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    use npyz::WriterBuilder;
    let mut w = npyz::WriteOptions::<f32>::new().default_dtype().shape(shape).writer(std::io::BufWriter::new(file)).begin_nd()?;
    w.extend(values.iter().copied())?;
    w.finish()?;
    Ok(())
}
