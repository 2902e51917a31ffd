//! What runs leave behind, consumers of their results only: Parquet tables (`store`), the Markdown report
//! (`report`), the regression verdict (`check`), two sweeps paired cell by cell (`compare`), charts (`plot`) and the
//! manifest of a run (`manifest`).

pub mod check;
pub mod compare;
pub mod manifest;
pub mod plot;
pub mod report;
pub mod store;
