//! A tool's description for the model. Chat templates take tools in the OpenAI function form
//! (transformers' `apply_chat_template(tools=...)`) and VeRL's tool config files hold them the
//! same way (`tool_schema:`), so that one form is both what [`ToolSchema`] reads and what it
//! writes.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A tool's name, description and JSON schema of its arguments.
///
/// Through serde it reads and writes the OpenAI function form, so it can sit directly in a config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "Value")]
pub struct ToolSchema {
    /// The name the model calls the tool by.
    pub name: String,
    /// What the tool does, for the model to decide when to call it.
    pub description: String,
    /// A JSON schema of type `object` describing the arguments.
    pub parameters: Value,
}

/// Why a JSON value is not a tool schema.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// A required field is absent; `0` is its path, e.g. `function.name`.
    #[error("the tool schema has no \"{0}\"; write it as {form}", form = FORM)]
    Missing(&'static str),
    /// A field is present with the wrong kind of value.
    #[error("the tool schema's \"{field}\" must be {expected}; write it as {form}", form = FORM)]
    WrongType {
        /// The field's path, e.g. `function.parameters`.
        field: &'static str,
        /// What it must be, e.g. `a JSON object`.
        expected: &'static str,
    },
}

/// The accepted form, quoted in every error so the fix is in the message.
const FORM: &str = "{\"type\": \"function\", \"function\": {\"name\": ..., \"description\": ..., \
                    \"parameters\": {\"type\": \"object\", \"properties\": {...}, \"required\": [...]}}}";

impl ToolSchema {
    /// The OpenAI function form: `{"type": "function", "function": {"name", "description",
    /// "parameters"}}`.
    pub fn to_json(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }

    /// Reads the OpenAI function form; other keys (e.g. `strict`) are ignored.
    pub fn from_json(value: &Value) -> Result<ToolSchema, SchemaError> {
        let object = value.as_object().ok_or(SchemaError::WrongType {
            field: "(the schema itself)",
            expected: "a JSON object",
        })?;
        match object.get("type") {
            None => return Err(SchemaError::Missing("type")),
            Some(Value::String(kind)) if kind == "function" => {}
            Some(_) => {
                return Err(SchemaError::WrongType {
                    field: "type",
                    expected: "\"function\"",
                })
            }
        }
        let function = object
            .get("function")
            .ok_or(SchemaError::Missing("function"))?
            .as_object()
            .ok_or(SchemaError::WrongType {
                field: "function",
                expected: "a JSON object",
            })?;
        let name = string(function.get("name"), "function.name")?;
        if name.trim().is_empty() {
            return Err(SchemaError::WrongType {
                field: "function.name",
                expected: "a non-empty string",
            });
        }
        let description = string(function.get("description"), "function.description")?;
        let parameters = function
            .get("parameters")
            .ok_or(SchemaError::Missing("function.parameters"))?;
        if !parameters.is_object() {
            return Err(SchemaError::WrongType {
                field: "function.parameters",
                expected: "a JSON object (a JSON schema)",
            });
        }
        match parameters.get("type") {
            None => return Err(SchemaError::Missing("function.parameters.type")),
            Some(Value::String(kind)) if kind == "object" => {}
            // Tool arguments are always an object, so any other schema type is a mistake.
            Some(_) => {
                return Err(SchemaError::WrongType {
                    field: "function.parameters.type",
                    expected: "\"object\"",
                })
            }
        }
        Ok(ToolSchema {
            name: name.to_string(),
            description: description.to_string(),
            parameters: parameters.clone(),
        })
    }
}

fn string<'a>(value: Option<&'a Value>, field: &'static str) -> Result<&'a str, SchemaError> {
    value
        .ok_or(SchemaError::Missing(field))?
        .as_str()
        .ok_or(SchemaError::WrongType {
            field,
            expected: "a string",
        })
}

impl TryFrom<Value> for ToolSchema {
    type Error = SchemaError;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        ToolSchema::from_json(&value)
    }
}

impl From<ToolSchema> for Value {
    fn from(schema: ToolSchema) -> Self {
        schema.to_json()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"]
                }
            }
        })
    }

    #[test]
    fn round_trips_the_openai_function_form() {
        let schema = ToolSchema::from_json(&weather()).unwrap();
        assert_eq!(schema.name, "get_weather");
        assert_eq!(schema.description, "Current weather in a city.");
        assert_eq!(schema.parameters["required"], json!(["city"]));
        assert_eq!(schema.to_json(), weather());
    }

    #[test]
    fn serde_reads_and_writes_the_same_form_as_in_a_verl_tool_config() {
        let yaml_like: Vec<ToolSchema> = serde_json::from_value(json!([weather()])).unwrap();
        assert_eq!(yaml_like[0].name, "get_weather");
        assert_eq!(serde_json::to_value(&yaml_like[0]).unwrap(), weather());

        let error = serde_json::from_value::<ToolSchema>(json!({"type": "function"})).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("the tool schema has no \"function\""),
            "{error}"
        );
    }

    #[test]
    fn errors_name_the_missing_or_wrong_field_and_show_the_form() {
        let without = |path: &[&str]| {
            let mut value = weather();
            let (last, parents) = path.split_last().unwrap();
            let mut object = &mut value;
            for key in parents {
                object = &mut object[*key];
            }
            object.as_object_mut().unwrap().remove(*last);
            ToolSchema::from_json(&value).unwrap_err()
        };
        assert_eq!(without(&["type"]), SchemaError::Missing("type"));
        assert_eq!(without(&["function"]), SchemaError::Missing("function"));
        assert_eq!(
            without(&["function", "name"]),
            SchemaError::Missing("function.name")
        );
        assert_eq!(
            without(&["function", "description"]),
            SchemaError::Missing("function.description")
        );
        assert_eq!(
            without(&["function", "parameters"]),
            SchemaError::Missing("function.parameters")
        );
        assert_eq!(
            without(&["function", "parameters", "type"]),
            SchemaError::Missing("function.parameters.type")
        );

        let message = without(&["function", "name"]).to_string();
        assert!(message.starts_with("the tool schema has no \"function.name\"; write it as {\"type\""));
    }

    #[test]
    fn wrong_kinds_of_values_are_refused() {
        let with = |pointer: &str, replacement: Value| {
            let mut value = weather();
            *value.pointer_mut(pointer).unwrap() = replacement;
            ToolSchema::from_json(&value).unwrap_err()
        };
        let wrong = |field, expected| SchemaError::WrongType { field, expected };
        assert_eq!(with("/type", json!("tool")), wrong("type", "\"function\""));
        assert_eq!(with("/function", json!("f")), wrong("function", "a JSON object"));
        assert_eq!(
            with("/function/name", json!(3)),
            wrong("function.name", "a string")
        );
        assert_eq!(
            with("/function/name", json!(" ")),
            wrong("function.name", "a non-empty string")
        );
        assert_eq!(
            with("/function/parameters", json!([])),
            wrong("function.parameters", "a JSON object (a JSON schema)")
        );
        assert_eq!(
            with("/function/parameters/type", json!("string")),
            wrong("function.parameters.type", "\"object\"")
        );
        assert_eq!(
            ToolSchema::from_json(&json!("calculator")).unwrap_err(),
            wrong("(the schema itself)", "a JSON object")
        );
    }
}
