//! The tool interface and the toolbox a rollout calls tools through.
//!
//! Tools run inside the rollout, so a tool's failure must become text for the model, never a
//! crash: every way a call can go wrong is a [`ToolError`] whose message the rollout shows the
//! model as the observation, and [`Toolbox::call`] turns a panicking tool into one too.

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::call::ToolCall;
use crate::schema::ToolSchema;

/// Something the model can call. Shared by every rollout worker, hence `Send + Sync`.
pub trait Tool: Send + Sync {
    /// The tool's name, description and arguments, shown to the model through the chat template.
    fn schema(&self) -> ToolSchema;

    /// Runs the tool. `arguments` is a JSON object; the `Ok` string is the observation the model
    /// sees next.
    fn call(&self, arguments: &Value) -> Result<String, ToolError>;

    /// Runs the tool for a call of an episode. Tools that take the dataset row's arguments or
    /// keep state per episode (user tools, which receive both) override it; the rest ignore
    /// the context.
    fn call_in(&self, arguments: &Value, context: &CallContext) -> Result<String, ToolError> {
        let _ = context;
        self.call(arguments)
    }

    /// The time limit the tool enforces itself (by killing its process or dropping its
    /// request), when it has one; the rollout then waits this long (plus a little) instead of
    /// its default limit for in-process tools.
    fn time_limit(&self) -> Option<Duration> {
        None
    }
}

/// Where a call comes from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CallContext {
    /// The episode's id: the same for each call of one sample's episode, and a new one when the
    /// episode is run again (after a weight update, or on another worker).
    pub episode: String,
    /// The dataset row's arguments for this tool, VeRL's `extra_info.tools_kwargs.<tool name>`
    /// (`create_kwargs`, `execute_kwargs`, ...), or null.
    pub kwargs: Value,
}

/// Why a call produced no result. The message is shown to the model, so it says what was wrong in
/// words the model can act on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// The model's arguments are unusable (missing, of the wrong type, or rejected by the tool,
    /// like a calculator expression with a syntax error): the model can fix them.
    #[error("invalid arguments: {0}")]
    BadArguments(String),
    /// The tool could not do its work for a reason that is not the arguments' fault; the string
    /// is the whole sentence (e.g. `the tool panicked: ...`).
    #[error("{0}")]
    Failed(String),
    /// The tool ran past its time limit and was stopped (process and HTTP tools).
    #[error("the tool did not finish within {0:?} and was stopped")]
    TimedOut(Duration),
    /// The model called a tool that is not in the toolbox.
    #[error("there is no tool named {name:?}; {}", available(.known))]
    UnknownTool {
        /// The name the model used.
        name: String,
        /// The toolbox's tool names, in order.
        known: Vec<String>,
    },
}

fn available(known: &[String]) -> String {
    if known.is_empty() {
        "no tools are available".to_string()
    } else {
        format!("the tools are: {}", known.join(", "))
    }
}

/// [`Toolbox::new`] got two tools with one name, so calls to that name would be ambiguous.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("two tools are named {0:?}; give each tool its own name")]
pub struct DuplicateTool(pub String);

/// The tools of a rollout, found by name. Cloning shares the tools.
#[derive(Clone, Default)]
pub struct Toolbox {
    /// Each tool with its schema, taken once at construction: schemas do not change, and the
    /// rollout asks for them on every prompt.
    tools: Vec<(ToolSchema, Arc<dyn Tool>)>,
}

impl Toolbox {
    /// A toolbox of `tools`, kept in the given order (the order the chat template lists them in).
    pub fn new(tools: impl IntoIterator<Item = Arc<dyn Tool>>) -> Result<Toolbox, DuplicateTool> {
        let mut toolbox = Toolbox::default();
        for tool in tools {
            let schema = tool.schema();
            if toolbox.find(&schema.name).is_some() {
                return Err(DuplicateTool(schema.name));
            }
            toolbox.tools.push((schema, tool));
        }
        Ok(toolbox)
    }

    /// The tools' schemas, in order, for the chat template's `tools`.
    pub fn schemas(&self) -> Vec<ToolSchema> {
        self.tools.iter().map(|(schema, _)| schema.clone()).collect()
    }

    /// The tools' names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.tools
            .iter()
            .map(|(schema, _)| schema.name.as_str())
            .collect()
    }

    /// Whether there are no tools (the rollout is then single-turn).
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Runs the tool `call` names. A panic in the tool is caught and returned as
    /// [`ToolError::Failed`], so one broken tool cannot end a rollout.
    pub fn call(&self, call: &ToolCall) -> Result<String, ToolError> {
        self.call_in(call, &CallContext::default())
    }

    /// Runs the tool `call` names for an episode ([`Tool::call_in`]), a panic caught as in
    /// [`Toolbox::call`].
    pub fn call_in(&self, call: &ToolCall, context: &CallContext) -> Result<String, ToolError> {
        let tool = self.find(&call.name).ok_or_else(|| ToolError::UnknownTool {
            name: call.name.clone(),
            known: self.names().into_iter().map(str::to_string).collect(),
        })?;
        catch_unwind(AssertUnwindSafe(|| tool.call_in(&call.arguments, context))).unwrap_or_else(|payload| {
            Err(ToolError::Failed(format!(
                "the tool panicked: {}",
                panic_message(&*payload)
            )))
        })
    }

    /// The time limit the named tool enforces itself ([`Tool::time_limit`]).
    pub fn time_limit(&self, name: &str) -> Option<Duration> {
        self.find(name).and_then(|tool| tool.time_limit())
    }

    fn find(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools
            .iter()
            .find(|(schema, _)| schema.name == name)
            .map(|(_, tool)| tool)
    }
}

impl fmt::Debug for Toolbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Toolbox").field("tools", &self.names()).finish()
    }
}

/// The text of a panic: `panic!` gives a `&str` or a `String`; anything else has no message.
fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Answers with its name and arguments, or panics when asked to.
    struct Echo(&'static str);

    impl Tool for Echo {
        fn schema(&self) -> ToolSchema {
            ToolSchema {
                name: self.0.to_string(),
                description: "Echoes its arguments.".to_string(),
                parameters: json!({"type": "object", "properties": {}}),
            }
        }

        fn call(&self, arguments: &Value) -> Result<String, ToolError> {
            match arguments.get("panic").and_then(Value::as_str) {
                Some(message) => panic!("{}", message.to_string()),
                None => Ok(format!("{} {arguments}", self.0)),
            }
        }
    }

    fn toolbox(names: &[&'static str]) -> Result<Toolbox, DuplicateTool> {
        Toolbox::new(names.iter().map(|name| Arc::new(Echo(name)) as Arc<dyn Tool>))
    }

    fn call(name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            name: name.to_string(),
            arguments,
        }
    }

    #[test]
    fn calls_the_tool_by_name_and_keeps_the_order() {
        let toolbox = toolbox(&["a", "b"]).unwrap();
        assert_eq!(toolbox.names(), vec!["a", "b"]);
        assert_eq!(
            toolbox
                .schemas()
                .iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(toolbox.call(&call("b", json!({"x": 1}))).unwrap(), "b {\"x\":1}");
        assert!(!toolbox.is_empty());
        assert_eq!(format!("{toolbox:?}"), "Toolbox { tools: [\"a\", \"b\"] }");
    }

    #[test]
    fn refuses_two_tools_with_one_name() {
        let error = toolbox(&["a", "b", "a"]).unwrap_err();
        assert_eq!(error, DuplicateTool("a".to_string()));
        assert_eq!(
            error.to_string(),
            "two tools are named \"a\"; give each tool its own name"
        );
    }

    #[test]
    fn an_unknown_tool_is_an_error_naming_the_known_ones() {
        let error = toolbox(&["calculator", "search"])
            .unwrap()
            .call(&call("calc", json!({})))
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "there is no tool named \"calc\"; the tools are: calculator, search"
        );
        let empty = Toolbox::default();
        assert!(empty.is_empty());
        assert_eq!(
            empty.call(&call("calc", json!({}))).unwrap_err().to_string(),
            "there is no tool named \"calc\"; no tools are available"
        );
    }

    #[test]
    fn a_panicking_tool_becomes_an_error_and_the_toolbox_still_works() {
        let toolbox = toolbox(&["a"]).unwrap();
        let error = toolbox.call(&call("a", json!({"panic": "boom"}))).unwrap_err();
        assert_eq!(error, ToolError::Failed("the tool panicked: boom".to_string()));
        assert_eq!(error.to_string(), "the tool panicked: boom");
        assert_eq!(toolbox.call(&call("a", json!({}))).unwrap(), "a {}");
    }

    #[test]
    fn error_messages_read_as_sentences() {
        assert_eq!(
            ToolError::BadArguments("\"expression\" is missing".to_string()).to_string(),
            "invalid arguments: \"expression\" is missing"
        );
        assert_eq!(
            ToolError::TimedOut(Duration::from_millis(1500)).to_string(),
            "the tool did not finish within 1.5s and was stopped"
        );
    }
}
