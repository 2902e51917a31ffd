//! What runs leave behind, consumers of their results only: Parquet tables (`store`), the Markdown report
//! (`report`), the regression verdict (`check`), charts (`plot`) and the manifest of a run (`manifest`).

pub mod check;
pub mod manifest;
pub mod plot;
pub mod report;
pub mod store;
