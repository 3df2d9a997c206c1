//! The learner of a step, under its old path: the learner role ([`crate::roles::learner`]) owns
//! it now, in process and over gRPC. Re-exported here for callers of `actors::run::learner`.

pub use crate::roles::learner::{
    initial_params, needs_reference, param_specs, policy, step_config, LearnerError, LocalLearner, Row,
    UpdateReport,
};
