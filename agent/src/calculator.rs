//! The built-in `calculator` tool: exact arithmetic for the model, which is unreliable at
//! multi-digit products and long division. Results are exact (rationals over integers of any
//! size), so a rollout's reward never depends on a rounding the model could not see.

mod expr;

use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::Signed;
use serde_json::{json, Value};

use crate::schema::ToolSchema;
use crate::tool::{Tool, ToolError};

/// The `calculator` tool. Takes `{"expression": "..."}` and answers with the exact value: an
/// integer as digits, anything else as a reduced fraction with its decimal value, e.g.
/// `7/3 (≈ 2.3333333333)` or `5/2 (= 2.5)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Calculator;

/// The decimal value of a fraction shows at least this many significant digits.
const DECIMAL_DIGITS: usize = 10;

impl Tool for Calculator {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "calculator".to_string(),
            description: "Evaluates an arithmetic expression exactly: integers of any size, decimals, \
                          + - * / // % ** and parentheses."
                .to_string(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": format!(
                            "The expression in Python syntax, e.g. \"(12 + 3) * 4 ** 2 // 7\"; at most {} \
                             characters. / divides exactly, // and % round down like Python's.",
                            expr::MAX_CHARS
                        )
                    }
                },
                "required": ["expression"]
            }),
        }
    }

    fn call(&self, arguments: &Value) -> Result<String, ToolError> {
        let expression = match arguments.get("expression") {
            Some(Value::String(expression)) => expression,
            Some(_) => {
                return Err(ToolError::BadArguments(
                    "\"expression\" must be a string, as in {\"expression\": \"2 + 2\"}".to_string(),
                ))
            }
            None => {
                return Err(ToolError::BadArguments(
                    "\"expression\" is missing; call calculator with {\"expression\": \"2 + 2\"}".to_string(),
                ))
            }
        };
        let value = expr::evaluate(expression).map_err(|error| ToolError::BadArguments(error.to_string()))?;
        Ok(show(&value))
    }
}

/// An integer as its digits; a fraction as `n/d (= decimal)` when the decimal is exact at the
/// shown precision, `n/d (≈ decimal)` otherwise.
fn show(value: &BigRational) -> String {
    if value.is_integer() {
        return value.numer().to_string();
    }
    let (decimal, exact) = decimal(value);
    format!("{value} ({} {decimal})", if exact { "=" } else { "≈" })
}

/// `value` in decimal with [`DECIMAL_DIGITS`] significant digits (more for values of 1 and above,
/// which keep all their integer digits), rounded half away from zero, trailing zeros dropped; and
/// whether that is exact.
fn decimal(value: &BigRational) -> (String, bool) {
    let magnitude = value.abs();
    // A value below 1 starts with about (denominator digits - numerator digits) zeros after the
    // point; these do not count towards the significant digits.
    let leading_zeros = magnitude
        .denom()
        .to_string()
        .len()
        .saturating_sub(magnitude.numer().to_string().len());
    let places = DECIMAL_DIGITS + leading_zeros;
    let scaled = magnitude * BigRational::from_integer(BigInt::from(10).pow(places as u32));
    let exact = scaled.is_integer();
    let digits = format!("{:0>width$}", scaled.round().to_integer(), width = places + 1);
    let (whole, fraction) = digits.split_at(digits.len() - places);
    let fraction = fraction.trim_end_matches('0');
    let sign = if value.is_negative() { "-" } else { "" };
    let decimal = if fraction.is_empty() {
        format!("{sign}{whole}")
    } else {
        format!("{sign}{whole}.{fraction}")
    };
    (decimal, exact)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calculate(expression: &str) -> Result<String, ToolError> {
        Calculator.call(&json!({ "expression": expression }))
    }

    #[test]
    fn integers_are_shown_as_digits() {
        assert_eq!(
            calculate("98765432123 * 123456789").unwrap(),
            "12193263114103033047"
        );
        assert_eq!(calculate("-2 ** 2").unwrap(), "-4");
        assert_eq!(calculate("10 / 2").unwrap(), "5");
    }

    #[test]
    fn fractions_are_shown_reduced_with_their_decimal_value() {
        assert_eq!(calculate("7 / 3").unwrap(), "7/3 (≈ 2.3333333333)");
        assert_eq!(calculate("-7 / 3").unwrap(), "-7/3 (≈ -2.3333333333)");
        assert_eq!(calculate("2 / 3").unwrap(), "2/3 (≈ 0.6666666667)");
        assert_eq!(calculate("10 / 4").unwrap(), "5/2 (= 2.5)");
        assert_eq!(calculate("0.1 + 0.2").unwrap(), "3/10 (= 0.3)");
        assert_eq!(calculate("1 / 1024").unwrap(), "1/1024 (= 0.0009765625)");
        assert_eq!(
            calculate("1 / 3000000").unwrap(),
            "1/3000000 (≈ 0.0000003333333333)"
        );
        assert_eq!(
            calculate("2 - 1/10**12").unwrap(),
            "1999999999999/1000000000000 (≈ 2)"
        );
    }

    #[test]
    fn bad_expressions_are_bad_arguments_with_the_reason() {
        assert_eq!(
            calculate("1 / 0").unwrap_err(),
            ToolError::BadArguments("division by zero at column 3".to_string())
        );
        assert_eq!(
            calculate("2 ** 100000").unwrap_err().to_string(),
            "invalid arguments: the number at column 3 is too large: the limit is 10000 digits"
        );
        assert_eq!(
            calculate(&"1".repeat(1001)).unwrap_err().to_string(),
            "invalid arguments: the expression is 1001 characters long; the limit is 1000"
        );
    }

    #[test]
    fn arguments_must_hold_an_expression_string() {
        assert_eq!(
            Calculator.call(&json!({})).unwrap_err().to_string(),
            "invalid arguments: \"expression\" is missing; call calculator with {\"expression\": \"2 + 2\"}"
        );
        assert_eq!(
            Calculator
                .call(&json!({"expression": 4}))
                .unwrap_err()
                .to_string(),
            "invalid arguments: \"expression\" must be a string, as in {\"expression\": \"2 + 2\"}"
        );
    }

    #[test]
    fn schema_is_a_valid_tool_schema_requiring_the_expression() {
        let schema = Calculator.schema();
        assert_eq!(schema.name, "calculator");
        assert_eq!(ToolSchema::from_json(&schema.to_json()).unwrap(), schema);
        assert_eq!(schema.parameters["required"], json!(["expression"]));
        assert_eq!(schema.parameters["properties"]["expression"]["type"], "string");
    }
}
