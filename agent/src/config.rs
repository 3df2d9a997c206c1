//! A tool config file (VeRL's `rollout.multi_turn.tool_config_path`): the tools of a run, laid
//! out as VeRL lays them out (`tools:`, each with `class_name`, `config` and `tool_schema`), with
//! grpo's classes:
//!
//! ```yaml
//! tools:
//!   - class_name: python          # the sandboxed Python executor
//!     config: {memory_limit_mb: 1024, default_timeout: 30, interpreter: python3}
//!     tool_schema:                 # optional for built-ins: renames or re-describes the tool
//!       type: function
//!       function: {name: code_interpreter, description: Runs Python code., parameters: {...}}
//!   - class_name: calculator
//!   - class_name: command          # a JSON-lines child process (agent::external)
//!     config: {command: [python3, my_tools.py], timeout: 10, max_in_flight: 8}
//!     tool_schema: {type: function, function: {name: search, description: ..., parameters: {...}}}
//!   - class_name: http             # an HTTP endpoint (agent::external)
//!     config: {url: "http://127.0.0.1:8000/tools", timeout: 10, max_in_flight: 8}
//!     tool_schema: {...}
//! ```
//!
//! `config.type` may be `native`, VeRL's value for these; VeRL's own Python classes
//! (`verl.tools.*`) and MCP tools are refused with what to write instead.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::external::ExternalTool;
use crate::interaction::Interaction;
use crate::schema::ToolSchema;
use crate::tool::{CallContext, Tool, ToolError};
use crate::Calculator;

/// One tool of a config file, validated, not yet started.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolSpec {
    /// The built-in calculator.
    Calculator {
        /// Replaces the built-in schema (a new name or description).
        schema: Option<ToolSchema>,
    },
    /// The built-in Python executor.
    Python {
        /// Interpreter, memory limit; its time limit is `timeout` or the run's default.
        interpreter: PathBuf,
        /// Address-space limit in MiB.
        memory_mb: u64,
        /// Time limit of a run; none: the run's `tool_timeout_s`.
        timeout: Option<Duration>,
        /// Most runs at once; none: one per CPU.
        max_processes: Option<usize>,
        /// Replaces the built-in schema.
        schema: Option<ToolSchema>,
    },
    /// A JSON-lines child process.
    Command {
        /// Executable and arguments.
        program: Vec<String>,
        /// Time limit of a call; none: the run's `tool_timeout_s`.
        timeout: Option<Duration>,
        /// Most calls outstanding.
        max_in_flight: usize,
        /// What the model sees.
        schema: ToolSchema,
    },
    /// An HTTP endpoint.
    Http {
        /// Where to `POST`.
        url: String,
        /// Time limit of a call; none: the run's `tool_timeout_s`.
        timeout: Option<Duration>,
        /// Most calls outstanding.
        max_in_flight: usize,
        /// What the model sees.
        schema: ToolSchema,
    },
}

/// Why a tool config file cannot be used; the message names the file and the entry.
#[derive(Debug, thiserror::Error)]
#[error("tool config {path}: {message}")]
pub struct ToolFileError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong and what to write instead.
    pub message: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tools: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    class_name: String,
    #[serde(default)]
    config: serde_yaml::Mapping,
    #[serde(default)]
    tool_schema: Option<Value>,
}

/// `type: native`, the one VeRL tool type grpo's classes are.
#[derive(Deserialize, Default)]
#[serde(rename_all = "snake_case")]
enum Kind {
    #[default]
    Native,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CalculatorConfig {
    #[serde(default, rename = "type")]
    _kind: Kind,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PythonConfig {
    #[serde(default, rename = "type")]
    _kind: Kind,
    #[serde(default = "default_memory_mb")]
    memory_limit_mb: u64,
    default_timeout: Option<f64>,
    #[serde(default = "default_interpreter")]
    interpreter: PathBuf,
    max_processes: Option<usize>,
}

fn default_memory_mb() -> u64 {
    1024
}
fn default_interpreter() -> PathBuf {
    PathBuf::from("python3")
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CommandConfig {
    #[serde(default, rename = "type")]
    _kind: Kind,
    command: Vec<String>,
    timeout: Option<f64>,
    #[serde(default = "default_in_flight")]
    max_in_flight: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpConfig {
    #[serde(default, rename = "type")]
    _kind: Kind,
    url: String,
    timeout: Option<f64>,
    #[serde(default = "default_in_flight")]
    max_in_flight: usize,
}

fn default_in_flight() -> usize {
    8
}

/// The program of a `command` or `http` entry (tools and interactions alike): what runs it,
/// its time limit (none: the run's `tool_timeout_s`) and its requests in flight.
fn external_program(
    class_name: &str,
    config: &serde_yaml::Mapping,
) -> Result<(Program, Option<Duration>, usize), String> {
    let value = serde_yaml::Value::Mapping(config.clone());
    let config_error = |e: serde_yaml::Error| format!("config: {e}");
    let (program, timeout, max_in_flight) = if class_name == "command" {
        let c: CommandConfig = serde_yaml::from_value(value).map_err(config_error)?;
        if c.command.is_empty() {
            return Err(
                "config.command is empty; give the program and its arguments, e.g. [python3, tools.py]"
                    .into(),
            );
        }
        (Program::Command(c.command), c.timeout, c.max_in_flight)
    } else {
        let c: HttpConfig = serde_yaml::from_value(value).map_err(config_error)?;
        if !(c.url.starts_with("http://") || c.url.starts_with("https://")) {
            return Err(format!("config.url {:?} is not an http:// address", c.url));
        }
        (Program::Http(c.url), c.timeout, c.max_in_flight)
    };
    if max_in_flight == 0 {
        return Err("config.max_in_flight must be at least 1".into());
    }
    Ok((program, seconds(timeout, "timeout")?, max_in_flight))
}

/// Reads the config file at `path` and validates it with `parse`; errors name the file.
fn read<T>(path: &Path, parse: impl FnOnce(&str) -> Result<T, String>) -> Result<T, ToolFileError> {
    let fail = |message: String| ToolFileError {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot be read: {e}")))?;
    parse(&text).map_err(fail)
}

/// Reads and validates a tool config file.
pub fn load(path: &Path) -> Result<Vec<ToolSpec>, ToolFileError> {
    read(path, parse)
}

/// Reads a file of tool schemas: a YAML or JSON list of OpenAI function tools (`{type:
/// function, function: {name, description, parameters}}`), the `tools` an agent program sends
/// with its calls.
pub fn load_schemas(path: &Path) -> Result<Vec<ToolSchema>, ToolFileError> {
    read(path, parse_schemas)
}

/// Validates a tool schema file's text.
pub fn parse_schemas(text: &str) -> Result<Vec<ToolSchema>, String> {
    let list: Vec<Value> = serde_yaml::from_str(text)
        .map_err(|e| format!("{e}; the file is a list of OpenAI tools, `- {{type: function, function: {{name, description, parameters}}}}`"))?;
    let schemas = list
        .iter()
        .enumerate()
        .map(|(k, v)| ToolSchema::from_json(v).map_err(|e| format!("[{k}]: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut names: Vec<&str> = schemas.iter().map(|s| s.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("two tools are named {:?}", w[0]));
    }
    Ok(schemas)
}

/// Validates a tool config file's text.
pub fn parse(text: &str) -> Result<Vec<ToolSpec>, String> {
    let file: File = serde_yaml::from_str(text).map_err(|e| {
        format!("{e}; the file is `tools:`, a list of entries with `class_name`, `config` and `tool_schema`")
    })?;
    if file.tools.is_empty() {
        return Err("`tools` is empty; list at least one tool".into());
    }
    file.tools
        .iter()
        .enumerate()
        .map(|(k, entry)| spec(entry).map_err(|e| format!("tools[{k}] ({}): {e}", entry.class_name)))
        .collect()
}

fn seconds(value: Option<f64>, key: &str) -> Result<Option<Duration>, String> {
    match value {
        None => Ok(None),
        Some(s) if s > 0.0 && s <= 3600.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(format!("config.{key} is {s}; give seconds above 0, at most 3600")),
    }
}

fn spec(entry: &Entry) -> Result<ToolSpec, String> {
    fn config<T: serde::de::DeserializeOwned>(entry: &Entry) -> Result<T, String> {
        serde_yaml::from_value(serde_yaml::Value::Mapping(entry.config.clone()))
            .map_err(|e| format!("config: {e}"))
    }
    let schema = match &entry.tool_schema {
        None => None,
        Some(value) => Some(ToolSchema::from_json(value).map_err(|e| format!("tool_schema: {e}"))?),
    };
    let required = |schema: Option<ToolSchema>| {
        schema.ok_or_else(|| {
            "needs a `tool_schema`: the model learns the tool's name and arguments from it".to_string()
        })
    };
    let in_flight = |n: usize| {
        if n == 0 {
            Err("config.max_in_flight must be at least 1".to_string())
        } else {
            Ok(n)
        }
    };
    match entry.class_name.as_str() {
        "calculator" => {
            let _: CalculatorConfig = config(entry)?;
            Ok(ToolSpec::Calculator { schema })
        }
        "python" => {
            let c: PythonConfig = config(entry)?;
            Ok(ToolSpec::Python {
                interpreter: c.interpreter,
                memory_mb: c.memory_limit_mb,
                timeout: seconds(c.default_timeout, "default_timeout")?,
                max_processes: c.max_processes.map(in_flight).transpose()?,
                schema,
            })
        }
        "command" | "http" => {
            let (program, timeout, max_in_flight) = external_program(&entry.class_name, &entry.config)?;
            let schema = required(schema)?;
            Ok(match program {
                Program::Command(program) => ToolSpec::Command {
                    program,
                    timeout,
                    max_in_flight,
                    schema,
                },
                Program::Http(url) => ToolSpec::Http {
                    url,
                    timeout,
                    max_in_flight,
                    schema,
                },
            })
        }
        "verl.tools.sandbox_fusion_tools.SandboxFusionTool" => Err(
            "grpo runs code in its own sandbox rather than calling a SandboxFusion service: write `class_name: \
             python` (config.memory_limit_mb and config.default_timeout keep their meaning; sandbox_fusion_url \
             and the rate-limit keys have no counterpart)"
                .into(),
        ),
        other if other.starts_with("verl.") || other.contains('.') => Err(format!(
            "{other:?} is a Python tool class, which grpo does not import; serve the tool as a JSON-lines \
             program (`class_name: command`, requests {{\"id\", \"tool\", \"arguments\"}}, answers {{\"id\", \
             \"result\"}}) or an HTTP endpoint (`class_name: http`); the classes are calculator, python, command, \
             http"
        )),
        other => Err(format!(
            "unknown class_name {other:?}; the classes are calculator, python, command, http"
        )),
    }
}

/// One interaction of an interaction config file (VeRL's `interaction_config_path`):
///
/// ```yaml
/// interaction:
///   - name: gsm8k                 # what a row's extra_info.interaction_kwargs.name picks
///     class_name: command         # or http
///     config: {command: [python3, grader.py], timeout: 10, max_in_flight: 8}
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct InteractionSpec {
    /// Its name.
    pub name: String,
    /// The program: executable and arguments, or an HTTP address.
    pub program: Program,
    /// Time limit of a reply; none: the run's `tool_timeout_s`.
    pub timeout: Option<Duration>,
    /// Most requests outstanding.
    pub max_in_flight: usize,
}

/// Where an interaction runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Program {
    /// A JSON-lines child process.
    Command(Vec<String>),
    /// An HTTP endpoint.
    Http(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InteractionFile {
    interaction: Vec<InteractionEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InteractionEntry {
    name: String,
    class_name: String,
    #[serde(default)]
    config: serde_yaml::Mapping,
}

/// Reads and validates an interaction config file.
pub fn load_interactions(path: &Path) -> Result<Vec<InteractionSpec>, ToolFileError> {
    read(path, parse_interactions)
}

/// Validates an interaction config file's text.
pub fn parse_interactions(text: &str) -> Result<Vec<InteractionSpec>, String> {
    let file: InteractionFile = serde_yaml::from_str(text).map_err(|e| {
        format!("{e}; the file is `interaction:`, a list of entries with `name`, `class_name` and `config`")
    })?;
    if file.interaction.is_empty() {
        return Err("`interaction` is empty; list at least one".into());
    }
    let mut specs: Vec<InteractionSpec> = Vec::new();
    for (k, entry) in file.interaction.iter().enumerate() {
        let at = |e: String| format!("interaction[{k}] ({}): {e}", entry.name);
        if specs.iter().any(|s| s.name == entry.name) {
            return Err(at("another interaction has this name; give each its own".into()));
        }
        let spec = match entry.class_name.as_str() {
            "command" | "http" => {
                let (program, timeout, max_in_flight) = external_program(&entry.class_name, &entry.config).map_err(at)?;
                InteractionSpec {
                    name: entry.name.clone(),
                    program,
                    timeout,
                    max_in_flight,
                }
            }
            other => {
                return Err(at(format!(
                    "class_name {other:?}: grpo does not import Python interaction classes; run the \
                     interaction as a JSON-lines program (`class_name: command`, config.command) or an HTTP \
                     endpoint (`class_name: http`, config.url) answering {{\"content\", \"done\", \"reward\"}} \
                     (docs/tools.md)"
                )))
            }
        };
        specs.push(spec);
    }
    Ok(specs)
}

impl InteractionSpec {
    /// Starts the interaction (a command starts at its first request); `default_timeout` is
    /// the run's `tool_timeout_s`, `key` names where it was configured.
    pub fn build(&self, default_timeout: Duration, key: &str) -> Interaction {
        let timeout = self.timeout.unwrap_or(default_timeout);
        match &self.program {
            Program::Command(program) => {
                Interaction::command(&self.name, key, program.clone(), timeout, self.max_in_flight)
            }
            Program::Http(url) => Interaction::http(&self.name, url, timeout, self.max_in_flight),
        }
    }
}

/// A built-in tool shown to the model under another schema (a tool file's `tool_schema` on a
/// built-in): the calls reach the built-in unchanged.
struct Renamed {
    schema: ToolSchema,
    inner: Arc<dyn Tool>,
}

impl Tool for Renamed {
    fn schema(&self) -> ToolSchema {
        self.schema.clone()
    }
    fn call(&self, arguments: &Value) -> Result<String, ToolError> {
        self.inner.call(arguments)
    }
    fn call_in(&self, arguments: &Value, context: &CallContext) -> Result<String, ToolError> {
        self.inner.call_in(arguments, context)
    }
    fn time_limit(&self) -> Option<Duration> {
        self.inner.time_limit()
    }
}

impl ToolSpec {
    /// Starts the tool (the Python executor runs its self-test here; commands start at their
    /// first call). `default_timeout` is the run's `tool_timeout_s`; `key` names the setting the
    /// spec came from, for errors.
    pub fn build(&self, default_timeout: Duration, key: &str) -> Result<Arc<dyn Tool>, String> {
        let (tool, schema): (Arc<dyn Tool>, Option<&ToolSchema>) = match self {
            ToolSpec::Calculator { schema } => (Arc::new(Calculator), schema.as_ref()),
            ToolSpec::Python {
                interpreter,
                memory_mb,
                timeout,
                max_processes,
                schema,
            } => (
                python(
                    interpreter,
                    *memory_mb,
                    timeout.unwrap_or(default_timeout),
                    *max_processes,
                )?,
                schema.as_ref(),
            ),
            ToolSpec::Command {
                program,
                timeout,
                max_in_flight,
                schema,
            } => (
                Arc::new(ExternalTool::command(
                    schema.clone(),
                    key,
                    program.clone(),
                    timeout.unwrap_or(default_timeout),
                    *max_in_flight,
                )),
                None,
            ),
            ToolSpec::Http {
                url,
                timeout,
                max_in_flight,
                schema,
            } => (
                Arc::new(ExternalTool::http(
                    schema.clone(),
                    url,
                    timeout.unwrap_or(default_timeout),
                    *max_in_flight,
                )),
                None,
            ),
        };
        Ok(match schema {
            Some(schema) => Arc::new(Renamed {
                schema: schema.clone(),
                inner: tool,
            }),
            None => tool,
        })
    }
}

#[cfg(target_os = "linux")]
fn python(
    interpreter: &Path,
    memory_mb: u64,
    timeout: Duration,
    max_processes: Option<usize>,
) -> Result<Arc<dyn Tool>, String> {
    let processes =
        max_processes.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    crate::python::Python::new(crate::python::PythonSettings {
        interpreter: interpreter.to_path_buf(),
        timeout,
        memory_mb,
        max_processes: processes,
    })
    .map(|python| Arc::new(python) as Arc<dyn Tool>)
    .map_err(|e| format!("the python tool: {e}"))
}

#[cfg(not(target_os = "linux"))]
fn python(_: &Path, _: u64, _: Duration, _: Option<usize>) -> Result<Arc<dyn Tool>, String> {
    Err("the python tool's sandbox (Landlock and seccomp) exists on Linux only".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEARCH: &str = "{type: function, function: {name: search, description: Finds pages., \
                          parameters: {type: object, properties: {query: {type: string}}, required: [query]}}}";

    #[test]
    fn reads_every_class() {
        let text = format!(
            "tools:\n  - class_name: calculator\n  - class_name: python\n    config: {{type: native, memory_limit_mb: 512, default_timeout: 5}}\n  - class_name: command\n    config: {{command: [python3, t.py], timeout: 2}}\n    tool_schema: {SEARCH}\n  - class_name: http\n    config: {{url: 'http://127.0.0.1:9/t', max_in_flight: 2}}\n    tool_schema: {SEARCH}\n"
        );
        let specs = parse(&text).unwrap();
        assert_eq!(specs[0], ToolSpec::Calculator { schema: None });
        assert_eq!(
            specs[1],
            ToolSpec::Python {
                interpreter: PathBuf::from("python3"),
                memory_mb: 512,
                timeout: Some(Duration::from_secs(5)),
                max_processes: None,
                schema: None
            }
        );
        assert!(
            matches!(&specs[2], ToolSpec::Command { program, timeout: Some(t), max_in_flight: 8, schema }
            if program == &["python3", "t.py"] && *t == Duration::from_secs(2) && schema.name == "search")
        );
        assert!(matches!(
            &specs[3],
            ToolSpec::Http {
                max_in_flight: 2,
                timeout: None,
                ..
            }
        ));
    }

    #[test]
    fn errors_name_the_entry_and_what_to_write() {
        let cases = [
            ("tools: []", "`tools` is empty"),
            ("tool: []", "unknown field `tool`"),
            (
                "tools:\n  - class_name: command\n    config: {command: [x]}",
                "tools[0] (command): needs a `tool_schema`",
            ),
            (
                "tools:\n  - class_name: python\n    config: {memory: 5}",
                "tools[0] (python): config: unknown field `memory`",
            ),
            (
                "tools:\n  - class_name: calculator\n    config: {type: mcp}",
                "unknown variant `mcp`",
            ),
            (
                "tools:\n  - class_name: python\n    config: {default_timeout: 0}",
                "config.default_timeout is 0",
            ),
            (
                "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                "write `class_name: python`",
            ),
            (
                "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool",
                "serve the tool as a JSON-lines",
            ),
            ("tools:\n  - class_name: calc", "unknown class_name \"calc\""),
            (
                "tools:\n  - class_name: http\n    config: {url: localhost}",
                "is not an http:// address",
            ),
        ];
        for (text, expected) in cases {
            let message = parse(text).unwrap_err();
            assert!(message.contains(expected), "{text:?}: {message}");
        }
    }

    #[test]
    fn interaction_files() {
        let specs = parse_interactions(
            "interaction:\n  - name: gsm8k\n    class_name: command\n    config: {command: [python3, g.py], timeout: 3}\n  \
             - name: chat\n    class_name: http\n    config: {url: 'http://127.0.0.1:9/i'}\n",
        )
        .unwrap();
        assert_eq!(
            specs[0].program,
            Program::Command(vec!["python3".into(), "g.py".into()])
        );
        assert_eq!(specs[0].timeout, Some(Duration::from_secs(3)));
        assert_eq!((specs[1].name.as_str(), specs[1].max_in_flight), ("chat", 8));
        for (text, expected) in [
            ("interaction: []", "`interaction` is empty"),
            (
                "interaction:\n  - name: g\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction",
                "grpo does not import Python interaction classes",
            ),
            (
                "interaction:\n  - {name: g, class_name: http, config: {url: 'http://x'}}\n  - {name: g, class_name: http, config: {url: 'http://y'}}",
                "interaction[1] (g): another interaction has this name",
            ),
            ("interaction:\n  - {name: g, class_name: command, config: {}}", "missing field `command`"),
        ] {
            let message = parse_interactions(text).unwrap_err();
            assert!(message.contains(expected), "{text}: {message}");
        }
    }

    #[test]
    fn a_schema_on_a_builtin_renames_it() {
        let text = "tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: calc, description: Adds., parameters: {type: object, properties: {expression: {type: string}}}}}";
        let tool = parse(text).unwrap()[0]
            .build(Duration::from_secs(1), "k")
            .unwrap();
        assert_eq!(tool.schema().name, "calc");
        assert_eq!(
            tool.call(&serde_json::json!({"expression": "2 + 3"})).unwrap(),
            "5"
        );
    }

    #[test]
    fn tool_schema_files_are_lists_of_openai_tools_with_distinct_names() {
        let schemas = parse_schemas(&format!("- {SEARCH}\n")).unwrap();
        assert_eq!(schemas.len(), 1);
        let twice = parse_schemas(&format!("[{SEARCH}, {SEARCH}]")).unwrap_err();
        assert!(twice.contains("two tools are named"), "{twice}");
        let not_a_list = parse_schemas("tools: []").unwrap_err();
        assert!(not_a_list.contains("a list of OpenAI tools"), "{not_a_list}");
        let broken = parse_schemas("- {type: function, function: {description: x}}").unwrap_err();
        assert!(broken.starts_with("[0]: "), "{broken}");
    }
}
