//! Getting models and their files: GGUF / safetensors / pickle readers (`weights`), the hub (`hub`), the offline
//! assets (`assets`), and a named target resolved to a model with its tokenizer (`target`).

pub mod assets;
pub mod hub;
pub mod target;
pub mod weights;
