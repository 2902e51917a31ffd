//! Text in and out of token ids: tokenizers (`tokenizer`), chat templates (`chat`) and prompt datasets (`dataset`).

pub mod chat;
pub mod dataset;
pub mod tokenizer;
