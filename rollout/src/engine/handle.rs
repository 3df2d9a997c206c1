//! The engine on its own thread: commands in (requests, weight updates, environments'
//! answers), finished samples out, from any thread.

use super::{Engine, EngineOutput, GenerationRequest, Resume, Sample, Turn, TurnId};
use crate::error::{Result, RolloutError};
use crate::weights::EngineWeights;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The environment of multi-turn requests, called on the engine thread for each parked turn.
pub trait TurnHandler: Send + Sync {
    /// Must return at once (tools run elsewhere) and answer later through `resumer`; a turn
    /// never answered keeps its slot.
    fn on_turn(&self, turn: Turn, resumer: Resumer);

    /// Called for every sample the engine finishes, before it is sent: an environment that
    /// keeps state per episode learns here that an episode ended without another turn (a
    /// budget cut it, or the environment itself finished it).
    fn on_finished(&self, _sample: &Sample) {}

    /// Called for each run of an episode that ended without a finished sample
    /// ([`Engine::take_abandoned`]): a weight update restarted it, or the engine dropped it.
    /// No turn of that run will come; an environment frees what it kept for it.
    fn on_abandoned(&self, _id: TurnId) {}

    /// Whether turns cut by a budget park too (the environment then ends every episode, and
    /// a continuation past the response budget finishes the sample), instead of finishing
    /// their sample at once.
    fn parks_cut_turns(&self) -> bool {
        false
    }
}

/// Sends an environment's answers to the engine thread.
#[derive(Clone)]
pub struct Resumer {
    commands: Sender<Command>,
}

impl Resumer {
    /// Answers a parked turn (dropped when the engine has stopped: nothing waits for it).
    pub fn resume(&self, id: TurnId, resume: Resume) {
        let _ = self.commands.send(Command::Resume(id, resume));
    }
}

impl Engine {
    /// Moves the engine to its own thread and returns a handle that feeds it requests and
    /// weight updates and streams back finished samples while it runs.
    pub fn spawn(self) -> EngineHandle {
        self.spawn_with(None)
    }

    /// As [`Engine::spawn`], with the environment that answers multi-turn requests' turns
    /// (without one, such a request is rejected).
    pub fn spawn_with(mut self, environment: Option<Arc<dyn TurnHandler>>) -> EngineHandle {
        self.set_park_cut_turns(environment.as_ref().is_some_and(|e| e.parks_cut_turns()));
        let (commands, command_rx) = channel::<Command>();
        let (output_tx, outputs) = channel::<EngineOutput>();
        let resumer = Resumer {
            commands: commands.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("rollout-engine".into())
            .spawn(move || serve(self, command_rx, output_tx, environment, resumer))
            .expect("spawning the rollout engine thread");
        EngineHandle {
            commands,
            outputs,
            thread: Some(thread),
        }
    }
}

enum Command {
    Submit(GenerationRequest),
    SubmitAll(Vec<GenerationRequest>),
    UpdateWeights(u64, EngineWeights, Sender<Result<usize>>),
    Resume(TurnId, Resume),
    Shutdown,
}

/// The engine thread: applies commands between steps, steps while there is work, sends every
/// finished sample and rejection. Returns the engine (or the error that stopped it).
fn serve(
    mut engine: Engine,
    commands: Receiver<Command>,
    outputs: Sender<EngineOutput>,
    environment: Option<Arc<dyn TurnHandler>>,
    resumer: Resumer,
) -> Result<Engine> {
    let submit = |engine: &mut Engine, r: GenerationRequest| {
        let result = match (&r.multi_turn, &environment) {
            (Some(_), None) => Err(RolloutError::Rejected {
                request_id: r.id,
                problem: "a multi-turn request needs an environment; this engine has none".into(),
            }),
            _ => engine.submit(r),
        };
        if let Err(e) = result {
            let _ = outputs.send(EngineOutput::Rejected(e));
        }
    };
    loop {
        let mut batch = Vec::new();
        if engine.has_work() {
            batch.extend(commands.try_iter());
        } else {
            match commands.recv() {
                Ok(c) => batch.push(c),
                Err(_) => return Ok(engine),
            }
            batch.extend(commands.try_iter());
        }
        for c in batch {
            match c {
                Command::Submit(r) => submit(&mut engine, r),
                Command::SubmitAll(rs) => {
                    for r in rs {
                        submit(&mut engine, r);
                    }
                }
                Command::Resume(id, resume) => {
                    if let Err(e) = engine.resume(id, resume) {
                        let _ = outputs.send(EngineOutput::Rejected(e));
                    }
                }
                Command::UpdateWeights(v, w, reply) => {
                    let _ = reply.send(engine.update_weights(v, w));
                }
                Command::Shutdown => return Ok(engine),
            }
        }
        if let Some(env) = &environment {
            for id in engine.take_abandoned() {
                env.on_abandoned(id);
            }
        }
        if engine.has_work() {
            for s in engine.step()? {
                if let Some(env) = &environment {
                    env.on_finished(&s);
                }
                let _ = outputs.send(EngineOutput::Sample(s));
            }
            if let Some(env) = &environment {
                for turn in engine.take_turns() {
                    env.on_turn(turn, resumer.clone());
                }
            }
        }
    }
}

/// A running engine on its own thread (see [`Engine::spawn`]); dropping it stops the thread
/// after its current step.
pub struct EngineHandle {
    commands: Sender<Command>,
    outputs: Receiver<EngineOutput>,
    thread: Option<JoinHandle<Result<Engine>>>,
}

/// The sending half of an [`EngineHandle`]: submits requests and weight updates from any
/// thread while another thread reads the outputs.
#[derive(Clone)]
pub struct EngineControl {
    commands: Sender<Command>,
}

impl EngineControl {
    /// Queues a request; its samples (or its rejection) arrive on [`EngineHandle::outputs`].
    pub fn submit(&self, request: GenerationRequest) -> Result<()> {
        self.commands
            .send(Command::Submit(request))
            .map_err(|_| RolloutError::Stopped("submit after the engine stopped".into()))
    }

    /// Queues several requests at once: the engine admits them together, in this order,
    /// before its next step, so which KV slot each sample gets (and with it the last bits of
    /// its arithmetic) does not depend on thread timing.
    pub fn submit_all(&self, requests: Vec<GenerationRequest>) -> Result<()> {
        self.commands
            .send(Command::SubmitAll(requests))
            .map_err(|_| RolloutError::Stopped("submit after the engine stopped".into()))
    }

    /// Installs new weights between two decode steps; waits until done and returns how many
    /// in-flight samples were restarted.
    pub fn update_weights(&self, version: u64, weights: impl Into<EngineWeights>) -> Result<usize> {
        let (tx, rx) = channel();
        self.commands
            .send(Command::UpdateWeights(version, weights.into(), tx))
            .map_err(|_| RolloutError::Stopped("update_weights after the engine stopped".into()))?;
        rx.recv()
            .map_err(|_| RolloutError::Stopped("the engine stopped before applying the weights".into()))?
    }
}

impl EngineHandle {
    /// A sending half for another thread (the engine keeps running until
    /// [`EngineHandle::shutdown`], even when every control is dropped).
    pub fn control(&self) -> EngineControl {
        EngineControl {
            commands: self.commands.clone(),
        }
    }

    /// Queues a request; its samples (or its rejection) arrive on [`EngineHandle::outputs`].
    pub fn submit(&self, request: GenerationRequest) -> Result<()> {
        self.commands
            .send(Command::Submit(request))
            .map_err(|_| RolloutError::Stopped("submit after the engine stopped".into()))
    }

    /// Installs new weights between two decode steps; waits until done and returns how many
    /// in-flight samples were restarted.
    pub fn update_weights(&self, version: u64, weights: impl Into<EngineWeights>) -> Result<usize> {
        let weights = weights.into();
        let (tx, rx) = channel();
        self.commands
            .send(Command::UpdateWeights(version, weights, tx))
            .map_err(|_| RolloutError::Stopped("update_weights after the engine stopped".into()))?;
        rx.recv()
            .map_err(|_| RolloutError::Stopped("the engine stopped before applying the weights".into()))?
    }

    /// The stream of finished samples and rejections (blocks in `recv` while generating).
    pub fn outputs(&self) -> &Receiver<EngineOutput> {
        &self.outputs
    }

    /// Stops the thread after the current step and returns the engine, or the error that
    /// stopped it earlier.
    pub fn shutdown(mut self) -> Result<Engine> {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.take().expect("joined only here");
        thread
            .join()
            .map_err(|_| RolloutError::Stopped("the engine thread panicked".into()))?
    }
}

impl Drop for EngineHandle {
    /// The thread holds a sender of its own commands (for environments' answers), so it would
    /// not see the channel close: tell it to stop.
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
    }
}
