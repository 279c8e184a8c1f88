//! Dynamic protobuf encoding and decoding driven by a parsed [`Schema`], with messages as JSON.
//!
//! JSON form: an object keyed by proto field names; `repeated` fields as arrays; maps as objects with
//! string keys (`"7"` for integer keys, `"true"` for bool keys) and values in this same form; integers
//! as JSON numbers (numeric strings are accepted when encoding); `bool`; strings; enums as numbers (value
//! names are accepted when encoding); `bytes` as standard base64 strings; `float`/`double` as numbers.
//! `null` or an absent key means "not set".
//!
//! Encoding follows proto3 and Go's marshaller: fields in number order; singular scalars equal to their
//! default are left out; singular messages are written even when empty; repeated numeric scalars are
//! packed; map entries carry key (1) and value (2). Decoding accepts packed and unpacked repeated scalars,
//! merges repeated occurrences of a singular message, skips unknown fields of any wire type, and leaves
//! absent fields out of the result.

use base64::Engine as _;
use base64::prelude::BASE64_STANDARD;
use serde_json::{Map, Value};

use super::proto::{Enum, Field, Message, ProtoError, Schema};
use super::wire::{
    RawValue, WireType, fixed, put_key, put_len_field, put_varint, raw_fields, read_varint,
};

/// Deepest message nesting accepted (guards against recursion on hostile input).
const MAX_DEPTH: usize = 64;

/// Encodes `value` (JSON form, see the module docs) as the message `message` of `schema`.
pub fn encode(schema: &Schema, message: &str, value: &Value) -> Result<Vec<u8>, ProtoError> {
    let msg = schema
        .message(message)
        .ok_or_else(|| ProtoError::UnknownMessage(message.to_string()))?;
    let mut out = Vec::new();
    Codec { schema }.encode_message(msg, value, message, &mut out, 0)?;
    Ok(out)
}

/// Decodes `bytes` as the message `message` of `schema` into its JSON form (see the module docs).
pub fn decode(schema: &Schema, message: &str, bytes: &[u8]) -> Result<Value, ProtoError> {
    let msg = schema
        .message(message)
        .ok_or_else(|| ProtoError::UnknownMessage(message.to_string()))?;
    Codec { schema }
        .decode_message(msg, bytes, message, 0)
        .map(Value::Object)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scalar {
    Int32,
    Int64,
    Uint32,
    Uint64,
    Sint32,
    Sint64,
    Bool,
    Fixed32,
    Fixed64,
    Sfixed32,
    Sfixed64,
    Float,
    Double,
    String,
    Bytes,
}

impl Scalar {
    fn parse(ty: &str) -> Option<Scalar> {
        Some(match ty {
            "int32" => Scalar::Int32,
            "int64" => Scalar::Int64,
            "uint32" => Scalar::Uint32,
            "uint64" => Scalar::Uint64,
            "sint32" => Scalar::Sint32,
            "sint64" => Scalar::Sint64,
            "bool" => Scalar::Bool,
            "fixed32" => Scalar::Fixed32,
            "fixed64" => Scalar::Fixed64,
            "sfixed32" => Scalar::Sfixed32,
            "sfixed64" => Scalar::Sfixed64,
            "float" => Scalar::Float,
            "double" => Scalar::Double,
            "string" => Scalar::String,
            "bytes" => Scalar::Bytes,
            _ => return None,
        })
    }

    fn wire(self) -> WireType {
        match self {
            Scalar::Fixed32 | Scalar::Sfixed32 | Scalar::Float => WireType::Fixed32,
            Scalar::Fixed64 | Scalar::Sfixed64 | Scalar::Double => WireType::Fixed64,
            Scalar::String | Scalar::Bytes => WireType::Len,
            _ => WireType::Varint,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Ty<'s> {
    Scalar(Scalar),
    Enum(&'s Enum),
    Message(&'s Message),
}

impl Ty<'_> {
    fn wire(self) -> WireType {
        match self {
            Ty::Scalar(s) => s.wire(),
            Ty::Enum(_) => WireType::Varint,
            Ty::Message(_) => WireType::Len,
        }
    }
}

/// What a field is, once its type is resolved.
#[derive(Clone, Copy, Debug)]
enum Shape<'s> {
    Single(Ty<'s>),
    Repeated(Ty<'s>),
    Map(Scalar, Ty<'s>),
}

#[derive(Clone, Copy, Debug)]
struct Codec<'s> {
    schema: &'s Schema,
}

fn enc_err(path: &str, message: impl Into<String>) -> ProtoError {
    ProtoError::Encode {
        path: path.to_string(),
        message: message.into(),
    }
}

fn dec_err(path: &str, message: impl Into<String>) -> ProtoError {
    ProtoError::Decode {
        path: path.to_string(),
        message: message.into(),
    }
}

impl<'s> Codec<'s> {
    fn ty(&self, ty: &str) -> Option<Ty<'s>> {
        Scalar::parse(ty)
            .map(Ty::Scalar)
            .or_else(|| self.schema.message(ty).map(Ty::Message))
            .or_else(|| self.schema.enumeration(ty).map(Ty::Enum))
    }

    fn shape(&self, field: &Field, path: &str) -> Result<Shape<'s>, String> {
        let unknown = |ty: &str| format!("{path}: unknown type {ty}");
        if let Some((k, v)) = field.map_types() {
            let key = Scalar::parse(k).ok_or_else(|| unknown(k))?;
            return Ok(Shape::Map(key, self.ty(v).ok_or_else(|| unknown(v))?));
        }
        let ty = self.ty(&field.ty).ok_or_else(|| unknown(&field.ty))?;
        Ok(if field.repeated {
            Shape::Repeated(ty)
        } else {
            Shape::Single(ty)
        })
    }

    fn encode_message(
        &self,
        msg: &Message,
        value: &Value,
        path: &str,
        out: &mut Vec<u8>,
        depth: usize,
    ) -> Result<(), ProtoError> {
        if depth > MAX_DEPTH {
            return Err(enc_err(path, "nested too deeply"));
        }
        let obj = match value {
            Value::Null => return Ok(()),
            Value::Object(obj) => obj,
            other => return Err(enc_err(path, format!("expected an object, got {other}"))),
        };
        if let Some(key) = obj.keys().find(|k| msg.field(k).is_none()) {
            return Err(enc_err(path, format!("{} has no field {key}", msg.name)));
        }
        let mut fields: Vec<&Field> = msg.fields.iter().collect();
        fields.sort_by_key(|f| f.number);
        for field in fields {
            let Some(v) = obj.get(&field.name).filter(|v| !v.is_null()) else {
                continue;
            };
            let path = format!("{path}.{}", field.name);
            match self.shape(field, &path).map_err(|m| enc_err(&path, m))? {
                Shape::Single(ty) => {
                    if !matches!(ty, Ty::Message(_)) && is_default(v) {
                        continue;
                    }
                    self.encode_value(field.number, ty, v, &path, out, depth)?;
                }
                Shape::Repeated(ty) => {
                    let items = v
                        .as_array()
                        .ok_or_else(|| enc_err(&path, "expected an array"))?;
                    if matches!(ty.wire(), WireType::Len) {
                        for (i, item) in items.iter().enumerate() {
                            let path = format!("{path}[{i}]");
                            self.encode_value(field.number, ty, item, &path, out, depth)?;
                        }
                    } else if !items.is_empty() {
                        let mut packed = Vec::new();
                        for (i, item) in items.iter().enumerate() {
                            self.encode_bare(
                                ty,
                                item,
                                &format!("{path}[{i}]"),
                                &mut packed,
                                depth,
                            )?;
                        }
                        put_len_field(out, field.number, &packed);
                    }
                }
                Shape::Map(key_ty, value_ty) => {
                    let entries = v
                        .as_object()
                        .ok_or_else(|| enc_err(&path, "expected an object (map)"))?;
                    for (k, val) in entries {
                        let path = format!("{path}[{k}]");
                        let key = map_key_value(key_ty, k).map_err(|m| enc_err(&path, m))?;
                        let mut entry = Vec::new();
                        self.encode_value(1, Ty::Scalar(key_ty), &key, &path, &mut entry, depth)?;
                        self.encode_value(2, value_ty, val, &path, &mut entry, depth)?;
                        put_len_field(out, field.number, &entry);
                    }
                }
            }
        }
        Ok(())
    }

    fn encode_value(
        &self,
        number: u32,
        ty: Ty<'_>,
        v: &Value,
        path: &str,
        out: &mut Vec<u8>,
        depth: usize,
    ) -> Result<(), ProtoError> {
        put_key(out, number, ty.wire());
        if ty.wire() == WireType::Len {
            let mut body = Vec::new();
            self.encode_bare(ty, v, path, &mut body, depth)?;
            put_varint(out, body.len() as u64);
            out.extend_from_slice(&body);
            Ok(())
        } else {
            self.encode_bare(ty, v, path, out, depth)
        }
    }

    /// The value without key (and without length prefix for length-delimited types).
    fn encode_bare(
        &self,
        ty: Ty<'_>,
        v: &Value,
        path: &str,
        out: &mut Vec<u8>,
        depth: usize,
    ) -> Result<(), ProtoError> {
        let err = |m: &str| enc_err(path, format!("{m}, got {v}"));
        let scalar = match ty {
            Ty::Message(msg) => return self.encode_message(msg, v, path, out, depth + 1),
            Ty::Enum(e) => {
                let n = match v.as_str() {
                    Some(name) => e.value(name).map(i64::from),
                    None => json_i64(v).filter(|n| i32::try_from(*n).is_ok()),
                };
                let n = n.ok_or_else(|| err(&format!("expected a value of enum {}", e.name)))?;
                put_varint(out, n as u64);
                return Ok(());
            }
            Ty::Scalar(s) => s,
        };
        let int = |lo: i64, hi: i64| {
            json_i64(v)
                .filter(|n| (lo..=hi).contains(n))
                .ok_or_else(|| err("expected an integer in range"))
        };
        let uint = |hi: u64| {
            json_u64(v)
                .filter(|n| *n <= hi)
                .ok_or_else(|| err("expected an unsigned integer in range"))
        };
        let float = || {
            v.as_f64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
                .ok_or_else(|| err("expected a number"))
        };
        match scalar {
            Scalar::Int32 => put_varint(out, int(i32::MIN.into(), i32::MAX.into())? as u64),
            Scalar::Int64 => put_varint(out, int(i64::MIN, i64::MAX)? as u64),
            Scalar::Uint32 => put_varint(out, uint(u32::MAX.into())?),
            Scalar::Uint64 => put_varint(out, uint(u64::MAX)?),
            Scalar::Sint32 | Scalar::Sint64 => {
                let n = if scalar == Scalar::Sint32 {
                    int(i32::MIN.into(), i32::MAX.into())?
                } else {
                    int(i64::MIN, i64::MAX)?
                };
                put_varint(out, ((n << 1) ^ (n >> 63)) as u64);
            }
            Scalar::Bool => put_varint(
                out,
                u64::from(v.as_bool().ok_or_else(|| err("expected a bool"))?),
            ),
            Scalar::Fixed32 => {
                out.extend_from_slice(&(uint(u32::MAX.into())? as u32).to_le_bytes())
            }
            Scalar::Sfixed32 => out
                .extend_from_slice(&(int(i32::MIN.into(), i32::MAX.into())? as i32).to_le_bytes()),
            Scalar::Float => out.extend_from_slice(&(float()? as f32).to_le_bytes()),
            Scalar::Fixed64 => out.extend_from_slice(&uint(u64::MAX)?.to_le_bytes()),
            Scalar::Sfixed64 => out.extend_from_slice(&int(i64::MIN, i64::MAX)?.to_le_bytes()),
            Scalar::Double => out.extend_from_slice(&float()?.to_le_bytes()),
            Scalar::String => out.extend_from_slice(
                v.as_str()
                    .ok_or_else(|| err("expected a string"))?
                    .as_bytes(),
            ),
            Scalar::Bytes => {
                let text = v.as_str().ok_or_else(|| err("expected a base64 string"))?;
                let raw = BASE64_STANDARD
                    .decode(text)
                    .map_err(|e| enc_err(path, format!("bad base64: {e}")))?;
                out.extend_from_slice(&raw);
            }
        }
        Ok(())
    }

    fn decode_message(
        &self,
        msg: &Message,
        bytes: &[u8],
        path: &str,
        depth: usize,
    ) -> Result<Map<String, Value>, ProtoError> {
        if depth > MAX_DEPTH {
            return Err(dec_err(path, "nested too deeply"));
        }
        let mut obj = Map::new();
        for item in raw_fields(bytes) {
            let (number, raw) = item.map_err(|m| dec_err(path, m))?;
            let Some(field) = msg.field_by_number(number) else {
                continue;
            };
            let path = format!("{path}.{}", field.name);
            match self.shape(field, &path).map_err(|m| dec_err(&path, m))? {
                Shape::Single(ty) => {
                    let v = self.decode_value(ty, raw, &path, depth)?;
                    match (obj.get_mut(&field.name), v) {
                        (Some(Value::Object(old)), Value::Object(new)) => merge(old, new),
                        (_, v) => {
                            obj.insert(field.name.clone(), v);
                        }
                    }
                }
                Shape::Repeated(ty) => {
                    let mut items = Vec::new();
                    match raw {
                        RawValue::Len(packed) if ty.wire() != WireType::Len => {
                            self.decode_packed(ty, packed, &path, &mut items)?
                        }
                        raw => items.push(self.decode_value(ty, raw, &path, depth)?),
                    }
                    let slot = obj
                        .entry(field.name.clone())
                        .or_insert_with(|| Value::Array(Vec::new()));
                    if let Value::Array(all) = slot {
                        all.extend(items);
                    }
                }
                Shape::Map(key_ty, value_ty) => {
                    let RawValue::Len(entry) = raw else {
                        return Err(dec_err(&path, "map entry is not length-delimited"));
                    };
                    let (mut key, mut value) = (None, None);
                    for item in raw_fields(entry) {
                        match item.map_err(|m| dec_err(&path, m))? {
                            (1, raw) => {
                                key = Some(self.decode_value(
                                    Ty::Scalar(key_ty),
                                    raw,
                                    &path,
                                    depth,
                                )?)
                            }
                            (2, raw) => {
                                value = Some(self.decode_value(value_ty, raw, &path, depth)?)
                            }
                            _ => {}
                        }
                    }
                    let key = match key.unwrap_or_else(|| default_of(Ty::Scalar(key_ty))) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    let value = value.unwrap_or_else(|| default_of(value_ty));
                    let slot = obj
                        .entry(field.name.clone())
                        .or_insert_with(|| Value::Object(Map::new()));
                    if let Value::Object(map) = slot {
                        map.insert(key, value);
                    }
                }
            }
        }
        Ok(obj)
    }

    fn decode_packed(
        &self,
        ty: Ty<'_>,
        mut packed: &[u8],
        path: &str,
        items: &mut Vec<Value>,
    ) -> Result<(), ProtoError> {
        while !packed.is_empty() {
            let raw = match ty.wire() {
                WireType::Fixed32 => {
                    let (head, rest) = packed
                        .split_at_checked(4)
                        .ok_or_else(|| dec_err(path, "short packed fixed32"))?;
                    packed = rest;
                    RawValue::Fixed32(u32::from_le_bytes(
                        fixed(head).map_err(|m| dec_err(path, m))?,
                    ))
                }
                WireType::Fixed64 => {
                    let (head, rest) = packed
                        .split_at_checked(8)
                        .ok_or_else(|| dec_err(path, "short packed fixed64"))?;
                    packed = rest;
                    RawValue::Fixed64(u64::from_le_bytes(
                        fixed(head).map_err(|m| dec_err(path, m))?,
                    ))
                }
                _ => {
                    let mut pos = 0;
                    let v = read_varint(packed, &mut pos)
                        .ok_or_else(|| dec_err(path, "truncated packed varint"))?;
                    packed = &packed[pos..];
                    RawValue::Varint(v)
                }
            };
            items.push(self.decode_value(ty, raw, path, 0)?);
        }
        Ok(())
    }

    fn decode_value(
        &self,
        ty: Ty<'_>,
        raw: RawValue<'_>,
        path: &str,
        depth: usize,
    ) -> Result<Value, ProtoError> {
        let mismatch = || dec_err(path, format!("wire value {raw:?} does not fit type {ty:?}"));
        let scalar = match (ty, raw) {
            (Ty::Message(msg), RawValue::Len(b)) => {
                return self
                    .decode_message(msg, b, path, depth + 1)
                    .map(Value::Object);
            }
            (Ty::Enum(_), RawValue::Varint(v)) => return Ok(Value::from(v as i32)),
            (Ty::Scalar(s), _) => s,
            _ => return Err(mismatch()),
        };
        Ok(match (scalar, raw) {
            (Scalar::Int32, RawValue::Varint(v)) => Value::from(v as i32),
            (Scalar::Int64, RawValue::Varint(v)) => Value::from(v as i64),
            (Scalar::Uint32, RawValue::Varint(v)) => Value::from(v as u32),
            (Scalar::Uint64, RawValue::Varint(v)) => Value::from(v),
            (Scalar::Sint32, RawValue::Varint(v)) => {
                Value::from(((v >> 1) as i64 ^ -((v & 1) as i64)) as i32)
            }
            (Scalar::Sint64, RawValue::Varint(v)) => {
                Value::from((v >> 1) as i64 ^ -((v & 1) as i64))
            }
            (Scalar::Bool, RawValue::Varint(v)) => Value::from(v != 0),
            (Scalar::Fixed32, RawValue::Fixed32(v)) => Value::from(v),
            (Scalar::Sfixed32, RawValue::Fixed32(v)) => Value::from(v as i32),
            (Scalar::Float, RawValue::Fixed32(v)) => float_value(f64::from(f32::from_bits(v))),
            (Scalar::Fixed64, RawValue::Fixed64(v)) => Value::from(v),
            (Scalar::Sfixed64, RawValue::Fixed64(v)) => Value::from(v as i64),
            (Scalar::Double, RawValue::Fixed64(v)) => float_value(f64::from_bits(v)),
            (Scalar::String, RawValue::Len(b)) => Value::from(
                std::str::from_utf8(b)
                    .map_err(|e| dec_err(path, format!("string is not UTF-8: {e}")))?,
            ),
            (Scalar::Bytes, RawValue::Len(b)) => Value::from(BASE64_STANDARD.encode(b)),
            _ => return Err(mismatch()),
        })
    }
}

fn float_value(f: f64) -> Value {
    serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
}

fn json_i64(v: &Value) -> Option<i64> {
    v.as_i64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

fn json_u64(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// The JSON value of a map key given as an object key.
fn map_key_value(ty: Scalar, key: &str) -> Result<Value, String> {
    match ty {
        Scalar::String => Ok(Value::from(key)),
        Scalar::Bool => key
            .parse::<bool>()
            .map(Value::from)
            .map_err(|_| format!("map key {key} is not a bool")),
        Scalar::Float | Scalar::Double | Scalar::Bytes => {
            Err(format!("{ty:?} cannot be a map key"))
        }
        _ => Ok(Value::from(key)),
    }
}

/// Whether a singular scalar value is its proto3 default (and so left out on the wire).
fn is_default(v: &Value) -> bool {
    match v {
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

fn default_of(ty: Ty<'_>) -> Value {
    match ty {
        Ty::Message(_) => Value::Object(Map::new()),
        Ty::Enum(_) => Value::from(0),
        Ty::Scalar(Scalar::String | Scalar::Bytes) => Value::from(""),
        Ty::Scalar(Scalar::Bool) => Value::from(false),
        Ty::Scalar(_) => Value::from(0),
    }
}

/// Proto merge of a message decoded again into an earlier occurrence.
fn merge(old: &mut Map<String, Value>, new: Map<String, Value>) {
    for (k, v) in new {
        match (old.get_mut(&k), v) {
            (Some(Value::Object(o)), Value::Object(n)) => merge(o, n),
            (Some(Value::Array(o)), Value::Array(n)) => o.extend(n),
            (_, v) => {
                old.insert(k, v);
            }
        }
    }
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
