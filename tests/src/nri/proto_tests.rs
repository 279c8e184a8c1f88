//! Tests of the `.proto` parser (against the upstream NRI `api.proto`).

use super::*;

fn upstream() -> Schema {
    load_upstream().expect("the upstream NRI api.proto parses")
}

fn field<'a>(schema: &'a Schema, message: &str, name: &str) -> &'a Field {
    schema
        .message(message)
        .unwrap_or_else(|| panic!("message {message} is parsed"))
        .field(name)
        .unwrap_or_else(|| panic!("{message}.{name} is parsed"))
}

#[test]
fn upstream_api_proto_known_facts() {
    let s = upstream();
    assert_eq!(s.package, "nri.pkg.api.v1alpha1");
    let pod = field(&s, "CreateContainerRequest", "pod");
    assert_eq!(
        (pod.number, pod.ty.as_str(), pod.repeated),
        (1, "PodSandbox", false)
    );
    let unified = field(&s, "LinuxResources", "unified");
    assert_eq!(
        (unified.number, unified.ty.as_str()),
        (6, "map<string,string>")
    );
    assert_eq!(unified.map_types(), Some(("string", "string")));
    assert_eq!(field(&s, "PodSandbox", "annotations").number, 6);
    let linux = field(&s, "ContainerAdjustment", "linux");
    assert_eq!(
        (linux.number, linux.ty.as_str()),
        (6, "LinuxContainerAdjustment")
    );
    let net = field(&s, "LinuxContainerAdjustment", "net_devices");
    assert_eq!(net.ty, "map<string,LinuxNetDevice>");
    let ips = field(&s, "PodSandbox", "ips");
    assert_eq!(
        (ips.number, ips.ty.as_str(), ips.repeated),
        (10, "string", true)
    );
    let event = s.enumeration("Event").expect("enum Event");
    assert_eq!(event.value("CREATE_CONTAINER"), Some(4));
    assert_eq!(event.value("LAST"), Some(15));
    // Inline empty messages, nested enums by simple and qualified name, services.
    assert!(
        s.message("RunPodSandboxResponse")
            .expect("parsed")
            .fields
            .is_empty()
    );
    assert_eq!(s.enumeration("LogRequest.Level"), s.enumeration("Level"));
    assert_eq!(field(&s, "LogRequest", "level").ty, "Level");
    assert_eq!(
        s.enumeration("ProfileType")
            .and_then(|e| e.value("LOCALHOST")),
        Some(2)
    );
    let plugin = &s.services["Plugin"];
    let create = plugin
        .method("CreateContainer")
        .expect("rpc CreateContainer");
    assert_eq!(
        (create.input.as_str(), create.output.as_str()),
        ("CreateContainerRequest", "CreateContainerResponse")
    );
    assert_eq!(s.services["HostFunctions"].methods.len(), 1);
    assert_eq!(
        s.services["Runtime"]
            .method("RegisterPlugin")
            .map(|m| m.output.as_str()),
        Some("Empty")
    );
    assert_eq!(
        field(&s, "FieldOwners", "compound").ty,
        "map<int32,CompoundFieldOwners>"
    );
    assert!(s.message("nri.pkg.api.v1alpha1.PodSandbox").is_some());
    assert!(s.message(".nri.pkg.api.v1alpha1.PodSandbox").is_some());
}

#[test]
fn parses_oneof_options_reserved_comments_and_nesting() {
    let text = r#"
        syntax = "proto3"; /* a block
        comment */ package demo.v1;
        import "google/protobuf/any.proto";
        option go_package = "x/y;y";
        message Outer {
            option deprecated = true;
            reserved 4, 6 to 8;
            reserved "gone";
            message Inner { int32 a = 1; }
            enum Kind { option allow_alias = true; K_ZERO = 0; K_NEG = -1 [deprecated = true]; }
            oneof choice {
                string text = 1;
                Inner inner = 2 [json_name = "inn"];
            }
            repeated .demo.v1.Outer.Inner many = 3; // trailing
            map< string , Inner > by_name = 5;
            Kind kind = 9;
        }
        message Inner { string top = 1; }
        message Empty{}
        service S { rpc Do(stream Outer) returns (Empty) { option idempotency_level = NO_SIDE_EFFECTS; } rpc Two(Empty) returns (Empty); }
    "#;
    let s = parse(text).expect("parses");
    let outer = s.message("Outer").expect("Outer");
    let names: Vec<_> = outer
        .fields
        .iter()
        .map(|f| (f.name.as_str(), f.number))
        .collect();
    assert_eq!(
        names,
        [
            ("text", 1),
            ("inner", 2),
            ("many", 3),
            ("by_name", 5),
            ("kind", 9)
        ]
    );
    assert_eq!(outer.fields[0].oneof.as_deref(), Some("choice"));
    assert!(outer.fields[2].repeated);
    assert_eq!(outer.fields[3].ty, "map<string,Inner>");
    // The top-level Inner keeps the simple name; the nested one is reachable qualified.
    assert_eq!(s.message("Inner").expect("Inner").fields[0].name, "top");
    assert_eq!(
        s.message("Outer.Inner").expect("nested").fields[0].name,
        "a"
    );
    assert_eq!(
        s.enumeration("Kind").and_then(|e| e.value("K_NEG")),
        Some(-1)
    );
    assert_eq!(s.services["S"].methods.len(), 2);
}

#[test]
fn reports_parse_errors_with_lines() {
    let err = parse("syntax = \"proto3\";\nmessage A {\n  string x = ;\n}\n").expect_err("bad");
    assert!(matches!(err, ProtoError::Parse { line: 3, .. }), "{err}");
    assert!(parse("message A { string x = 1;").is_err());
    assert!(parse("/* never closed").is_err());
    assert!(parse("message A { string x = 0; }").is_err());
}
