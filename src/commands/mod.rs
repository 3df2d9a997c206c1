//! One module per subcommand.

pub mod devices;
pub mod run;
pub mod preprocess;
pub mod generate;
pub mod worker;
