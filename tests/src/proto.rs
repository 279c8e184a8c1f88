//! Upstream `.proto` files read at test time (compiled by `protox`, no `protoc`), and protobuf
//! messages encoded and decoded through them as JSON (`prost-reflect`): the NRI runtime stand-in speaks
//! NRI with upstream's `api.proto`, and the drift tests read the agent's hand-kept prost structs with
//! upstream's definitions. The upstream files are never copied into the project.
//!
//! JSON form (proto3's JSON mapping, with these choices): objects keyed by the **proto field names**
//! (`pod_sandbox_id`), enums as **numbers**, 64-bit integers as JSON **numbers**, `bytes` as base64,
//! fields at their default value left out; a message field that is set is written even when empty.
//! Decoding skips unknown fields (so a field under another number is missing from the result);
//! encoding refuses a JSON key the message does not have.

use std::path::{Path, PathBuf};

use prost::Message as _;
use prost_reflect::ReflectMessage as _;
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions,
};
use serde_json::Value;

use crate::{Error, Result};

/// Where the upstream NRI `api.proto` is kept: the shared reference folder beside the repository.
pub fn upstream_nri_api_proto() -> PathBuf {
    reference_dir().join("nri/api.proto")
}

/// The shared reference folder (`../shared/reference` beside the repository).
pub fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference")
}

/// What [`Schema::coverage`] found: both empty when every field was set under upstream's number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Upstream's fields not set.
    pub unset: Vec<String>,
    /// Field numbers upstream's message does not have.
    pub unknown: Vec<u32>,
}

/// One compiled `.proto` file: its definitions, addressed by name within its package.
#[derive(Clone, Debug)]
pub struct Schema {
    path: PathBuf,
    package: String,
    pool: DescriptorPool,
}

impl Schema {
    /// Compiles the upstream NRI `api.proto` ([`upstream_nri_api_proto`]).
    pub fn nri() -> Result<Schema> {
        Schema::load(&upstream_nri_api_proto())
    }

    /// Compiles one self-contained `.proto` file.
    pub fn load(path: &Path) -> Result<Schema> {
        let compile = |message: String| Error::Compile {
            path: path.to_path_buf(),
            message,
        };
        let (dir, name) = match (path.parent(), path.file_name()) {
            (Some(dir), Some(name)) => (dir, name),
            _ => return Err(compile("not a file path".into())),
        };
        let mut compiler = protox::Compiler::new([dir]).map_err(|e| compile(e.to_string()))?;
        compiler
            .open_file(name)
            .map_err(|e| compile(format!("{e:?}")))?;
        let pool = compiler.descriptor_pool();
        let package = pool
            .files()
            .find(|f| Path::new(f.name()) == Path::new(name))
            .map(|f| f.package_name().to_string())
            .unwrap_or_default();
        Ok(Schema {
            path: path.to_path_buf(),
            package,
            pool,
        })
    }

    /// The names of the file's top-level messages.
    pub fn message_names(&self) -> Vec<String> {
        self.pool
            .files()
            .flat_map(|f| {
                f.messages()
                    .map(|m| m.name().to_string())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The file's `package`.
    pub fn package(&self) -> &str {
        &self.package
    }

    fn qualified(&self, name: &str) -> String {
        match self.package.as_str() {
            "" => name.to_string(),
            package => format!("{package}.{name}"),
        }
    }

    fn unknown(&self, what: &'static str, name: &str) -> Error {
        Error::UnknownDefinition {
            path: self.path.clone(),
            what,
            name: name.to_string(),
        }
    }

    /// The message `name` (within the package: `CreateContainerRequest`, `LinuxResources`).
    pub fn message(&self, name: &str) -> Result<MessageDescriptor> {
        self.pool
            .get_message_by_name(&self.qualified(name))
            .ok_or_else(|| self.unknown("message", name))
    }

    /// The number of the value `value` of the enum `name`.
    pub fn enum_value(&self, name: &str, value: &str) -> Result<i32> {
        let e = self
            .pool
            .get_enum_by_name(&self.qualified(name))
            .ok_or_else(|| self.unknown("enum", name))?;
        e.get_value_by_name(value)
            .map(|v| v.number())
            .ok_or_else(|| self.unknown("enum value", &format!("{name}.{value}")))
    }

    /// The methods of the service `name`, in declaration order: `(method, input, output)`, the message
    /// types named within the package.
    pub fn methods(&self, name: &str) -> Result<Vec<(String, String, String)>> {
        let service = self
            .pool
            .get_service_by_name(&self.qualified(name))
            .ok_or_else(|| self.unknown("service", name))?;
        Ok(service
            .methods()
            .map(|m| {
                (
                    m.name().to_string(),
                    m.input().name().to_string(),
                    m.output().name().to_string(),
                )
            })
            .collect())
    }

    /// Encodes `json` (the module's JSON form) as the message `message`.
    pub fn encode(&self, message: &str, json: &Value) -> Result<Vec<u8>> {
        let desc = self.message(message)?;
        DynamicMessage::deserialize_with_options(desc, json, &DeserializeOptions::new())
            .map(|m| m.encode_to_vec())
            .map_err(|e| Error::Encode {
                message: message.to_string(),
                json: json.to_string(),
                error: e.to_string(),
            })
    }

    /// Decodes `bytes` as the message `message` into the module's JSON form.
    pub fn decode(&self, message: &str, bytes: &[u8]) -> Result<Value> {
        let failed = |error: String| Error::Decode {
            message: message.to_string(),
            error,
        };
        let decoded = self.decode_message(message, bytes)?;
        let options = SerializeOptions::new()
            .use_proto_field_name(true)
            .use_enum_numbers(true)
            .stringify_64_bit_integers(false);
        decoded
            .serialize_with_options(serde_json::value::Serializer, &options)
            .map_err(|e| failed(e.to_string()))
    }

    /// How `bytes`, read as the message `message`, fall short of "every field set, none unknown": the
    /// names of upstream's fields left unset and the numbers of fields upstream does not have. A field
    /// under upstream's number with another wire type fails the decoding.
    pub fn coverage(&self, message: &str, bytes: &[u8]) -> Result<Coverage> {
        let decoded = self.decode_message(message, bytes)?;
        Ok(Coverage {
            unset: decoded
                .descriptor()
                .fields()
                .filter(|f| !decoded.has_field(f))
                .map(|f| f.name().to_string())
                .collect(),
            unknown: decoded.unknown_fields().map(|f| f.number()).collect(),
        })
    }

    /// Decodes `bytes` as the message `message`, unknown fields kept apart.
    pub fn decode_message(&self, message: &str, bytes: &[u8]) -> Result<DynamicMessage> {
        DynamicMessage::decode(self.message(message)?, bytes).map_err(|e| Error::Decode {
            message: message.to_string(),
            error: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn nri() -> Schema {
        Schema::nri().expect("the upstream NRI api.proto compiles")
    }

    #[test]
    fn nri_json_round_trips_in_the_kits_form() {
        let s = nri();
        let value = json!({
            "pod": {"id": "p", "labels": {"a": "b"}},
            "container": {"id": "c", "state": 1, "pid": 7,
                "linux": {"resources": {"memory": {"limit": {"value": 5_000_000_000_i64}}}}},
        });
        let bytes = s.encode("CreateContainerRequest", &value).expect("encodes");
        assert_eq!(
            s.decode("CreateContainerRequest", &bytes).expect("decodes"),
            value
        );
        // An empty message that is set stays; defaults are left out.
        let empty = json!({"pod": {}});
        let bytes = s.encode("CreateContainerRequest", &empty).expect("encodes");
        assert_eq!(
            s.decode("CreateContainerRequest", &bytes).expect("decodes"),
            empty
        );
    }

    #[test]
    fn bad_input_names_what_failed() {
        let s = nri();
        let e = s
            .encode("CreateContainerRequest", &json!({"no_such_field": 1}))
            .expect_err("unknown key");
        assert!(e.to_string().contains("CreateContainerRequest"), "{e}");
        let e = s.decode("Empty", &[0x0a, 0x09]).expect_err("truncated");
        assert!(e.to_string().starts_with("decoding Empty"), "{e}");
        let e = s.message("Nope").expect_err("unknown");
        assert!(e.to_string().ends_with("defines no message Nope"), "{e}");
        assert_eq!(s.enum_value("Event", "CREATE_CONTAINER").expect("value"), 4);
        assert!(s.enum_value("Event", "NOPE").is_err());
        let e = Schema::load(Path::new("/nonexistent/x.proto")).expect_err("missing");
        assert!(e.to_string().contains("/nonexistent/x.proto"), "{e}");
    }

    #[test]
    fn unknown_fields_are_skipped_when_decoding() {
        let s = nri();
        // Field 15 (varint) is not in Empty: skipped, not an error.
        assert_eq!(
            s.decode("Empty", &[0x78, 0x01]).expect("decodes"),
            json!({})
        );
    }

    #[test]
    fn services_list_their_methods_in_order() {
        let methods = nri().methods("Runtime").expect("service");
        assert_eq!(methods[0].0, "RegisterPlugin");
        assert_eq!(methods[0].1, "RegisterPluginRequest");
        assert!(methods.iter().any(|m| m.0 == "UpdateContainers"));
    }
}
