//! One module per subcommand.

pub mod compile;
pub mod devices;
pub mod export;
pub mod generate;
pub mod plot;
pub mod preprocess;
pub mod run;
pub mod serve;
pub mod verl;
pub mod worker;
