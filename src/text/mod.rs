//! Text in and out of token ids: tokenizers (`tokenizer`), chat templates (`chat`), prompt datasets (`dataset`) and
//! ShareGPT conversations (`sharegpt`).

pub mod chat;
pub mod dataset;
pub mod sharegpt;
pub mod tokenizer;
