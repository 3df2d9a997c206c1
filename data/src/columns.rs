//! Reading values out of Arrow columns: the prompt column (chat messages or plain text) and every
//! other column as JSON for the scorer.
//!
//! Each column is inspected once per record batch ([`JsonColumn::new`], [`PromptColumn::new`]):
//! the Arrow type is matched and the typed arrays are downcast up front, so reading a row is a
//! walk over already-typed arrays. [`check_json_type`] and [`check_prompt_type`] run the same
//! type checks from a file's schema alone, so a bad column is reported when the file is opened,
//! before any row is read.

use std::ops::Range;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, BooleanArray, LargeStringArray, StringArray, StringViewArray};
use arrow_schema::DataType;
use serde_json::{Map, Number, Value};

use crate::example::{Message, Prompt};

/// What the prompt column may hold, for error messages.
pub(crate) const PROMPT_TYPES: &str =
    "a string (plain-text prompt) or a list of structs with string fields `role` and `content` (chat messages)";

/// Offsets of a list-like array (32- or 64-bit).
#[derive(Clone, Copy)]
pub(crate) enum Offsets<'a> {
    Small(&'a [i32]),
    Large(&'a [i64]),
}

impl Offsets<'_> {
    fn range(&self, row: usize) -> Range<usize> {
        match self {
            Offsets::Small(offsets) => offsets[row] as usize..offsets[row + 1] as usize,
            Offsets::Large(offsets) => offsets[row] as usize..offsets[row + 1] as usize,
        }
    }
}

/// A string column of any Arrow string encoding, dictionary-encoded or not.
pub(crate) enum StrColumn<'a> {
    Utf8(&'a StringArray),
    LargeUtf8(&'a LargeStringArray),
    View(&'a StringViewArray),
    Dictionary {
        array: &'a dyn Array,
        keys: Vec<usize>,
        values: Box<StrColumn<'a>>,
    },
}

fn is_string_type(data_type: &DataType) -> bool {
    match data_type {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Dictionary(_, values) => is_string_type(values),
        _ => false,
    }
}

impl<'a> StrColumn<'a> {
    /// Returns `None` if `array` is not a string array.
    fn new(array: &'a dyn Array) -> Option<Self> {
        Some(match array.data_type() {
            DataType::Utf8 => StrColumn::Utf8(array.as_string::<i32>()),
            DataType::LargeUtf8 => StrColumn::LargeUtf8(array.as_string::<i64>()),
            DataType::Utf8View => StrColumn::View(array.as_string_view()),
            DataType::Dictionary(_, values) if is_string_type(values) => {
                let dictionary = array.as_any_dictionary();
                StrColumn::Dictionary {
                    array,
                    keys: dictionary.normalized_keys(),
                    values: Box::new(StrColumn::new(dictionary.values().as_ref())?),
                }
            }
            _ => return None,
        })
    }

    /// The string at `row`, or `None` if it is null.
    fn get(&self, row: usize) -> Option<&'a str> {
        match self {
            StrColumn::Utf8(array) => (!array.is_null(row)).then(|| array.value(row)),
            StrColumn::LargeUtf8(array) => (!array.is_null(row)).then(|| array.value(row)),
            StrColumn::View(array) => (!array.is_null(row)).then(|| array.value(row)),
            StrColumn::Dictionary { array, keys, values } => {
                if array.is_null(row) {
                    None
                } else {
                    values.get(keys[row])
                }
            }
        }
    }
}

/// Checks that a column of this type can be converted to JSON; the error describes the
/// unsupported part of the type.
pub(crate) fn check_json_type(data_type: &DataType) -> Result<(), String> {
    match data_type {
        DataType::Null
        | DataType::Boolean
        | DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32
        | DataType::UInt64
        | DataType::Float16
        | DataType::Float32
        | DataType::Float64
        | DataType::Utf8
        | DataType::LargeUtf8
        | DataType::Utf8View
        | DataType::Binary
        | DataType::LargeBinary
        | DataType::BinaryView
        | DataType::FixedSizeBinary(_) => Ok(()),
        DataType::List(field) | DataType::LargeList(field) | DataType::FixedSizeList(field, _) => {
            check_json_type(field.data_type())
        }
        DataType::Struct(fields) => fields
            .iter()
            .try_for_each(|field| check_json_type(field.data_type())),
        DataType::Map(entries, _) => check_json_type(entries.data_type()),
        DataType::Dictionary(_, values) => check_json_type(values),
        other => Err(format!(
            "{other} (columns are passed to the scorer as JSON, which this type has no \
             conversion for; cast it to a string or number, or drop the column)"
        )),
    }
}

/// A column of any supported type, read as JSON values.
pub(crate) struct JsonColumn<'a> {
    array: &'a dyn Array,
    kind: JsonKind<'a>,
}

type Reader<'a, T> = Box<dyn Fn(usize) -> T + 'a>;

enum JsonKind<'a> {
    Null,
    Boolean(&'a BooleanArray),
    Signed(Reader<'a, i64>),
    Unsigned(Reader<'a, u64>),
    Float(Reader<'a, f64>),
    Str(StrColumn<'a>),
    /// Binary values become lowercase hex strings (as `arrow-json` writes them).
    Bytes(Reader<'a, &'a [u8]>),
    List {
        offsets: Offsets<'a>,
        items: Box<JsonColumn<'a>>,
    },
    FixedSizeList {
        offset: Reader<'a, usize>,
        size: usize,
        items: Box<JsonColumn<'a>>,
    },
    Struct(Vec<(&'a str, JsonColumn<'a>)>),
    Map {
        offsets: Offsets<'a>,
        keys: Box<JsonColumn<'a>>,
        values: Box<JsonColumn<'a>>,
    },
    Dictionary {
        keys: Vec<usize>,
        values: Box<JsonColumn<'a>>,
    },
}

macro_rules! primitive_reader {
    ($array:expr, $arrow_type:ty, $convert:expr) => {{
        let typed = $array.as_primitive::<$arrow_type>();
        Box::new(move |row: usize| $convert(typed.value(row)))
    }};
}

impl<'a> JsonColumn<'a> {
    /// Prepares `array` for reading; fails with a description of the type if it has no JSON
    /// conversion (see [`check_json_type`]).
    pub(crate) fn new(array: &'a dyn Array) -> Result<Self, String> {
        let kind = match array.data_type() {
            DataType::Null => JsonKind::Null,
            DataType::Boolean => JsonKind::Boolean(array.as_boolean()),
            DataType::Int8 => JsonKind::Signed(primitive_reader!(array, Int8Type, i64::from)),
            DataType::Int16 => JsonKind::Signed(primitive_reader!(array, Int16Type, i64::from)),
            DataType::Int32 => JsonKind::Signed(primitive_reader!(array, Int32Type, i64::from)),
            DataType::Int64 => JsonKind::Signed(primitive_reader!(array, Int64Type, |v| v)),
            DataType::UInt8 => JsonKind::Unsigned(primitive_reader!(array, UInt8Type, u64::from)),
            DataType::UInt16 => JsonKind::Unsigned(primitive_reader!(array, UInt16Type, u64::from)),
            DataType::UInt32 => JsonKind::Unsigned(primitive_reader!(array, UInt32Type, u64::from)),
            DataType::UInt64 => JsonKind::Unsigned(primitive_reader!(array, UInt64Type, |v| v)),
            DataType::Float16 => {
                JsonKind::Float(primitive_reader!(array, Float16Type, |v: half::f16| v.to_f64()))
            }
            DataType::Float32 => JsonKind::Float(primitive_reader!(array, Float32Type, f64::from)),
            DataType::Float64 => JsonKind::Float(primitive_reader!(array, Float64Type, |v| v)),
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                JsonKind::Str(StrColumn::new(array).expect("matched string types"))
            }
            DataType::Binary => {
                let typed = array.as_binary::<i32>();
                JsonKind::Bytes(Box::new(move |row| typed.value(row)))
            }
            DataType::LargeBinary => {
                let typed = array.as_binary::<i64>();
                JsonKind::Bytes(Box::new(move |row| typed.value(row)))
            }
            DataType::BinaryView => {
                let typed = array.as_binary_view();
                JsonKind::Bytes(Box::new(move |row| typed.value(row)))
            }
            DataType::FixedSizeBinary(_) => {
                let typed = array.as_fixed_size_binary();
                JsonKind::Bytes(Box::new(move |row| typed.value(row)))
            }
            DataType::List(_) => {
                let list = array.as_list::<i32>();
                JsonKind::List {
                    offsets: Offsets::Small(list.value_offsets()),
                    items: Box::new(JsonColumn::new(list.values().as_ref())?),
                }
            }
            DataType::LargeList(_) => {
                let list = array.as_list::<i64>();
                JsonKind::List {
                    offsets: Offsets::Large(list.value_offsets()),
                    items: Box::new(JsonColumn::new(list.values().as_ref())?),
                }
            }
            DataType::FixedSizeList(_, size) => {
                let list = array.as_fixed_size_list();
                JsonKind::FixedSizeList {
                    offset: Box::new(move |row| list.value_offset_at(row)),
                    size: *size as usize,
                    items: Box::new(JsonColumn::new(list.values().as_ref())?),
                }
            }
            DataType::Struct(fields) => {
                let structs = array.as_struct();
                let mut children = Vec::with_capacity(fields.len());
                for (field, column) in fields.iter().zip(structs.columns()) {
                    children.push((field.name().as_str(), JsonColumn::new(column.as_ref())?));
                }
                JsonKind::Struct(children)
            }
            DataType::Map(_, _) => {
                let map = array.as_map();
                JsonKind::Map {
                    offsets: Offsets::Small(map.value_offsets()),
                    keys: Box::new(JsonColumn::new(map.keys().as_ref())?),
                    values: Box::new(JsonColumn::new(map.values().as_ref())?),
                }
            }
            DataType::Dictionary(_, _) => {
                let dictionary = array.as_any_dictionary();
                JsonKind::Dictionary {
                    keys: dictionary.normalized_keys(),
                    values: Box::new(JsonColumn::new(dictionary.values().as_ref())?),
                }
            }
            other => return Err(check_json_type(other).expect_err("unsupported type")),
        };
        Ok(Self { array, kind })
    }

    /// The value at `row` as JSON (`null` for a null value, NaN or infinity).
    pub(crate) fn value(&self, row: usize) -> Value {
        if self.array.is_null(row) {
            return Value::Null;
        }
        match &self.kind {
            JsonKind::Null => Value::Null,
            JsonKind::Boolean(array) => Value::Bool(array.value(row)),
            JsonKind::Signed(read) => Value::Number(read(row).into()),
            JsonKind::Unsigned(read) => Value::Number(read(row).into()),
            JsonKind::Float(read) => Number::from_f64(read(row)).map_or(Value::Null, Value::Number),
            JsonKind::Str(strings) => strings
                .get(row)
                .map_or(Value::Null, |text| Value::String(text.to_owned())),
            JsonKind::Bytes(read) => {
                let bytes = read(row);
                let mut hex = String::with_capacity(bytes.len() * 2);
                for byte in bytes {
                    hex.push_str(&format!("{byte:02x}"));
                }
                Value::String(hex)
            }
            JsonKind::List { offsets, items } => {
                Value::Array(offsets.range(row).map(|item| items.value(item)).collect())
            }
            JsonKind::FixedSizeList { offset, size, items } => {
                let start = offset(row);
                Value::Array((start..start + size).map(|item| items.value(item)).collect())
            }
            JsonKind::Struct(children) => Value::Object(
                children
                    .iter()
                    .map(|(name, column)| ((*name).to_owned(), column.value(row)))
                    .collect(),
            ),
            JsonKind::Map {
                offsets,
                keys,
                values,
            } => {
                let range = offsets.range(row);
                let pairs: Vec<(Value, Value)> = range
                    .map(|entry| (keys.value(entry), values.value(entry)))
                    .collect();
                if pairs.iter().all(|(key, _)| key.is_string()) {
                    let mut object = Map::new();
                    for (key, value) in pairs {
                        if let Value::String(key) = key {
                            object.insert(key, value);
                        }
                    }
                    Value::Object(object)
                } else {
                    Value::Array(
                        pairs
                            .into_iter()
                            .map(|(key, value)| Value::Array(vec![key, value]))
                            .collect(),
                    )
                }
            }
            JsonKind::Dictionary { keys, values } => values.value(keys[row]),
        }
    }
}

/// Whether a column type is a string (any encoding).
pub(crate) fn is_string_column_type(data_type: &DataType) -> bool {
    is_string_type(data_type)
}

/// Checks that a column can hold prompts; the error is the type found.
pub(crate) fn check_prompt_type(data_type: &DataType) -> Result<(), String> {
    if is_string_type(data_type) {
        return Ok(());
    }
    if let DataType::List(field) | DataType::LargeList(field) = data_type {
        if let DataType::Struct(fields) = field.data_type() {
            let string_field = |name: &str| {
                fields
                    .iter()
                    .any(|f| f.name() == name && is_string_type(f.data_type()))
            };
            if string_field("role") && string_field("content") {
                return Ok(());
            }
        }
    }
    Err(data_type.to_string())
}

/// The prompt column of one record batch.
pub(crate) enum PromptColumn<'a> {
    Text(StrColumn<'a>),
    Messages {
        list: &'a dyn Array,
        offsets: Offsets<'a>,
        messages: &'a dyn Array,
        roles: StrColumn<'a>,
        contents: StrColumn<'a>,
    },
}

impl<'a> PromptColumn<'a> {
    /// Prepares `array`; `None` if its type fails [`check_prompt_type`].
    pub(crate) fn new(array: &'a dyn Array) -> Option<Self> {
        if let Some(strings) = StrColumn::new(array) {
            return Some(PromptColumn::Text(strings));
        }
        let (offsets, messages) = match array.data_type() {
            DataType::List(_) => {
                let list = array.as_list::<i32>();
                (Offsets::Small(list.value_offsets()), list.values())
            }
            DataType::LargeList(_) => {
                let list = array.as_list::<i64>();
                (Offsets::Large(list.value_offsets()), list.values())
            }
            _ => return None,
        };
        let structs = messages.as_struct_opt()?;
        let roles = StrColumn::new(structs.column_by_name("role")?.as_ref())?;
        let contents = StrColumn::new(structs.column_by_name("content")?.as_ref())?;
        Some(PromptColumn::Messages {
            list: array,
            offsets,
            messages: messages.as_ref(),
            roles,
            contents,
        })
    }

    /// The prompt at `row`; the error says what is wrong with it (null, empty, a message
    /// without role or content).
    pub(crate) fn prompt(&self, row: usize) -> Result<Prompt, String> {
        match self {
            PromptColumn::Text(strings) => {
                let text = strings.get(row).ok_or_else(|| {
                    "the prompt is null; every row needs a prompt (drop the row or fill it in)".to_owned()
                })?;
                if text.trim().is_empty() {
                    return Err("the prompt is empty; every row needs a non-empty prompt".into());
                }
                Ok(Prompt::Text(text.to_owned()))
            }
            PromptColumn::Messages {
                list,
                offsets,
                messages,
                roles,
                contents,
            } => {
                if list.is_null(row) {
                    return Err(
                        "the prompt is null; every row needs a list of {role, content} messages".into(),
                    );
                }
                let range = offsets.range(row);
                if range.is_empty() {
                    return Err("the prompt has no messages; every row needs at least one \
                                {role, content} message"
                        .into());
                }
                let mut result = Vec::with_capacity(range.len());
                for (number, message) in range.enumerate() {
                    if messages.is_null(message) {
                        return Err(format!("message {number} of the prompt is null"));
                    }
                    let role = roles
                        .get(message)
                        .filter(|role| !role.trim().is_empty())
                        .ok_or_else(|| {
                            format!(
                                "message {number} of the prompt has no role (expected user, \
                                 system or assistant)"
                            )
                        })?;
                    let content = contents
                        .get(message)
                        .ok_or_else(|| format!("message {number} of the prompt has no content"))?;
                    result.push(Message::new(role, content));
                }
                if result.iter().all(|m| m.content.trim().is_empty()) {
                    return Err("the prompt is empty: every message's content is empty".into());
                }
                Ok(Prompt::Messages(result))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use arrow_array::builder::{
        Int64Builder, ListBuilder, MapBuilder, StringBuilder, StringDictionaryBuilder, StructBuilder,
    };
    use arrow_array::types::Int32Type;
    use arrow_array::{ArrayRef, Float64Array, Int64Array, ListArray, StructArray};
    use arrow_schema::{Field, Fields};
    use serde_json::json;

    /// A message as (role, content), either possibly null.
    type TestMessage<'a> = (Option<&'a str>, Option<&'a str>);

    fn messages_array(rows: &[Option<Vec<TestMessage>>]) -> ListArray {
        let fields = Fields::from(vec![
            Field::new("role", DataType::Utf8, true),
            Field::new("content", DataType::Utf8, true),
        ]);
        let mut builder = ListBuilder::new(StructBuilder::from_fields(fields, 0));
        for row in rows {
            match row {
                None => builder.append(false),
                Some(messages) => {
                    for (role, content) in messages {
                        let structs = builder.values();
                        structs
                            .field_builder::<StringBuilder>(0)
                            .unwrap()
                            .append_option(*role);
                        structs
                            .field_builder::<StringBuilder>(1)
                            .unwrap()
                            .append_option(*content);
                        structs.append(true);
                    }
                    builder.append(true);
                }
            }
        }
        builder.finish()
    }

    #[test]
    fn reads_chat_messages_and_reports_bad_ones() {
        let array = messages_array(&[
            Some(vec![
                (Some("system"), Some("Be brief.")),
                (Some("user"), Some("2+2?")),
            ]),
            None,
            Some(vec![]),
            Some(vec![(None, Some("hi"))]),
            Some(vec![(Some("user"), None)]),
            Some(vec![(Some("user"), Some("  "))]),
        ]);
        assert!(check_prompt_type(array.data_type()).is_ok());
        let column = PromptColumn::new(&array).unwrap();
        assert_eq!(
            column.prompt(0).unwrap(),
            Prompt::Messages(vec![
                Message::new("system", "Be brief."),
                Message::new("user", "2+2?")
            ])
        );
        assert!(column.prompt(1).unwrap_err().contains("the prompt is null"));
        assert!(column.prompt(2).unwrap_err().contains("no messages"));
        assert_eq!(
            column.prompt(3).unwrap_err(),
            "message 0 of the prompt has no role (expected user, system or assistant)"
        );
        assert_eq!(
            column.prompt(4).unwrap_err(),
            "message 0 of the prompt has no content"
        );
        assert!(column.prompt(5).unwrap_err().contains("content is empty"));
    }

    #[test]
    fn reads_text_prompts_including_dictionary_encoded() {
        let plain = StringArray::from(vec![Some("What is 1+1?"), None, Some("")]);
        let column = PromptColumn::new(&plain).unwrap();
        assert_eq!(column.prompt(0).unwrap(), Prompt::Text("What is 1+1?".into()));
        assert!(column.prompt(1).unwrap_err().contains("null"));
        assert!(column.prompt(2).unwrap_err().contains("empty"));

        let mut builder = StringDictionaryBuilder::<Int32Type>::new();
        builder.append_value("b");
        builder.append_value("a");
        builder.append_value("b");
        let dictionary = builder.finish();
        let column = PromptColumn::new(&dictionary).unwrap();
        assert_eq!(column.prompt(2).unwrap(), Prompt::Text("b".into()));
        assert_eq!(column.prompt(1).unwrap(), Prompt::Text("a".into()));
    }

    #[test]
    fn rejects_prompt_columns_of_other_types() {
        assert_eq!(check_prompt_type(&DataType::Int64).unwrap_err(), "Int64");
        let list_of_strings = DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)));
        assert!(check_prompt_type(&list_of_strings).is_err());
        let array = Int64Array::from(vec![1]);
        assert!(PromptColumn::new(&array).is_none());
    }

    #[test]
    fn converts_nested_columns_to_json() {
        let ints: ArrayRef = Arc::new(Int64Array::from(vec![Some(3), None]));
        let floats: ArrayRef = Arc::new(Float64Array::from(vec![0.5, f64::NAN]));
        let names: ArrayRef = Arc::new(StringArray::from(vec!["a", "b"]));
        let structs = StructArray::from(vec![
            (Arc::new(Field::new("n", DataType::Int64, true)), ints),
            (Arc::new(Field::new("x", DataType::Float64, true)), floats),
            (Arc::new(Field::new("s", DataType::Utf8, true)), names),
        ]);
        let column = JsonColumn::new(&structs).unwrap();
        assert_eq!(column.value(0), json!({"n": 3, "x": 0.5, "s": "a"}));
        assert_eq!(column.value(1), json!({"n": null, "x": null, "s": "b"}));

        let mut lists = ListBuilder::new(Int64Builder::new());
        lists.append_value([Some(1), Some(2)]);
        lists.append_null();
        let lists = lists.finish();
        let column = JsonColumn::new(&lists).unwrap();
        assert_eq!(column.value(0), json!([1, 2]));
        assert_eq!(column.value(1), Value::Null);

        let mut maps = MapBuilder::new(None, StringBuilder::new(), Int64Builder::new());
        maps.keys().append_value("k");
        maps.values().append_value(7);
        maps.append(true).unwrap();
        let maps = maps.finish();
        assert_eq!(JsonColumn::new(&maps).unwrap().value(0), json!({"k": 7}));

        let bytes = arrow_array::BinaryArray::from(vec![&b"\x01\xff"[..]]);
        assert_eq!(JsonColumn::new(&bytes).unwrap().value(0), json!("01ff"));
    }

    #[test]
    fn names_unsupported_types() {
        let error = check_json_type(&DataType::Date32).unwrap_err();
        assert!(error.starts_with("Date32 (columns are passed to the scorer as JSON"));
    }
}
