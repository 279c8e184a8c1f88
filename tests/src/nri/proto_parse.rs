//! The tokenizer and recursive-descent parser behind [`super::proto::parse`].

use super::proto::{Enum, Field, Message, Method, ProtoError, Schema, Service};

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Number(String),
    Str(String),
    Sym(char),
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

fn tokenize(text: &str) -> Result<Vec<Token>, ProtoError> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let (mut i, mut line) = (0, 1);
    let err = |line, message: &str| ProtoError::Parse {
        line,
        message: message.to_string(),
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let start = line;
            i += 2;
            loop {
                match (chars.get(i), chars.get(i + 1)) {
                    (Some('*'), Some('/')) => break i += 2,
                    (Some(ch), _) => {
                        if *ch == '\n' {
                            line += 1;
                        }
                        i += 1;
                    }
                    (None, _) => return Err(err(start, "unterminated /* comment")),
                }
            }
        } else if c == '"' || c == '\'' {
            let start = line;
            let mut s = String::new();
            i += 1;
            loop {
                match chars.get(i) {
                    None | Some('\n') => return Err(err(start, "unterminated string")),
                    Some(&q) if q == c => break i += 1,
                    Some('\\') => {
                        let escaped = chars.get(i + 1).copied().unwrap_or('\\');
                        s.push(match escaped {
                            'n' => '\n',
                            't' => '\t',
                            other => other,
                        });
                        i += 2;
                    }
                    Some(&ch) => {
                        s.push(ch);
                        i += 1;
                    }
                }
            }
            tokens.push(Token {
                tok: Tok::Str(s),
                line: start,
            });
        } else if c.is_ascii_digit() {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
            tokens.push(Token {
                tok: Tok::Number(chars[start..i].iter().collect()),
                line,
            });
        } else if c.is_ascii_alphabetic()
            || c == '_'
            || (c == '.' && next.is_some_and(|n| n.is_ascii_alphabetic() || n == '_'))
        {
            let start = i;
            i += 1;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == '.')
            {
                i += 1;
            }
            tokens.push(Token {
                tok: Tok::Ident(chars[start..i].iter().collect()),
                line,
            });
        } else if "{}[]()<>;=,-+:".contains(c) {
            tokens.push(Token {
                tok: Tok::Sym(c),
                line,
            });
            i += 1;
        } else {
            return Err(err(line, &format!("unexpected character {c:?}")));
        }
    }
    Ok(tokens)
}

/// `(simple name, qualified name, is enum)` of a nested type.
pub(super) type NestedAlias = (String, String, bool);

/// Parses `text`: the schema, and the nested types.
pub(super) fn parse_file(text: &str) -> Result<(Schema, Vec<NestedAlias>), ProtoError> {
    let mut parser = Parser {
        tokens: tokenize(text)?,
        pos: 0,
        schema: Schema::default(),
        nested_aliases: Vec::new(),
    };
    parser.file()?;
    Ok((parser.schema, parser.nested_aliases))
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    schema: Schema,
    nested_aliases: Vec<NestedAlias>,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.tokens.get(self.pos).map(|t| &t.tok)
    }

    fn line(&self) -> usize {
        self.tokens.get(self.pos).map_or(0, |t| t.line)
    }

    fn error(&self, message: impl Into<String>) -> ProtoError {
        ProtoError::Parse {
            line: self.line(),
            message: message.into(),
        }
    }

    fn next(&mut self) -> Result<Tok, ProtoError> {
        let tok = self
            .peek()
            .cloned()
            .ok_or_else(|| self.error("unexpected end of file"))?;
        self.pos += 1;
        Ok(tok)
    }

    fn is_sym(&self, c: char) -> bool {
        self.peek() == Some(&Tok::Sym(c))
    }

    fn is_ident(&self, word: &str) -> bool {
        matches!(self.peek(), Some(Tok::Ident(w)) if w == word)
    }

    fn eat_sym(&mut self, c: char) -> bool {
        let hit = self.is_sym(c);
        if hit {
            self.pos += 1;
        }
        hit
    }

    fn expect_sym(&mut self, c: char) -> Result<(), ProtoError> {
        if self.eat_sym(c) {
            Ok(())
        } else {
            Err(self.error(format!("expected '{c}', found {:?}", self.peek())))
        }
    }

    fn ident(&mut self) -> Result<String, ProtoError> {
        match self.next()? {
            Tok::Ident(w) => Ok(w),
            other => {
                self.pos -= 1;
                Err(self.error(format!("expected a name, found {other:?}")))
            }
        }
    }

    fn integer(&mut self) -> Result<i64, ProtoError> {
        let negative = self.eat_sym('-');
        let text = match self.next()? {
            Tok::Number(n) => n,
            other => {
                self.pos -= 1;
                return Err(self.error(format!("expected a number, found {other:?}")));
            }
        };
        let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
            Some(hex) => i64::from_str_radix(hex, 16),
            None if text.len() > 1 && text.starts_with('0') => i64::from_str_radix(&text[1..], 8),
            None => text.parse(),
        };
        let value = parsed.map_err(|_| self.error(format!("bad integer {text}")))?;
        Ok(if negative { -value } else { value })
    }

    /// Skips a statement up to and including its `;`, or a `{ ... }` block ending it.
    fn skip_statement(&mut self) -> Result<(), ProtoError> {
        let mut depth = 0usize;
        loop {
            match self.next()? {
                Tok::Sym('{') | Tok::Sym('[') | Tok::Sym('(') => depth += 1,
                Tok::Sym('}') | Tok::Sym(']') | Tok::Sym(')') => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or_else(|| self.error("unbalanced closing bracket"))?;
                    if depth == 0 && self.tokens[self.pos - 1].tok == Tok::Sym('}') {
                        self.eat_sym(';');
                        return Ok(());
                    }
                }
                Tok::Sym(';') if depth == 0 => return Ok(()),
                _ => {}
            }
        }
    }

    fn file(&mut self) -> Result<(), ProtoError> {
        while let Some(tok) = self.peek().cloned() {
            match tok {
                Tok::Sym(';') => self.pos += 1,
                Tok::Ident(w) if w == "package" => {
                    self.pos += 1;
                    self.schema.package = self.ident()?;
                    self.expect_sym(';')?;
                }
                Tok::Ident(w)
                    if ["syntax", "edition", "import", "option"].contains(&w.as_str()) =>
                {
                    self.skip_statement()?
                }
                Tok::Ident(w) if w == "message" => {
                    self.pos += 1;
                    self.message(None)?;
                }
                Tok::Ident(w) if w == "enum" => {
                    self.pos += 1;
                    self.enumeration(None)?;
                }
                Tok::Ident(w) if w == "service" => {
                    self.pos += 1;
                    self.service()?;
                }
                Tok::Ident(w) if w == "extend" => self.skip_statement()?,
                other => return Err(self.error(format!("unexpected {other:?} at top level"))),
            }
        }
        Ok(())
    }

    fn qualify(&mut self, scope: Option<&str>, name: &str, is_enum: bool) -> String {
        match scope {
            None => name.to_string(),
            Some(outer) => {
                let qualified = format!("{outer}.{name}");
                self.nested_aliases
                    .push((name.to_string(), qualified.clone(), is_enum));
                qualified
            }
        }
    }

    fn message(&mut self, scope: Option<&str>) -> Result<(), ProtoError> {
        let simple = self.ident()?;
        let name = self.qualify(scope, &simple, false);
        self.expect_sym('{')?;
        let mut fields = Vec::new();
        while !self.eat_sym('}') {
            match self.peek().cloned() {
                Some(Tok::Sym(';')) => self.pos += 1,
                Some(Tok::Ident(w)) if w == "message" => {
                    self.pos += 1;
                    self.message(Some(&name))?;
                }
                Some(Tok::Ident(w)) if w == "enum" => {
                    self.pos += 1;
                    self.enumeration(Some(&name))?;
                }
                Some(Tok::Ident(w)) if w == "oneof" => {
                    self.pos += 1;
                    let oneof = self.ident()?;
                    self.expect_sym('{')?;
                    while !self.eat_sym('}') {
                        if self.is_ident("option") {
                            self.skip_statement()?;
                        } else if !self.eat_sym(';') {
                            fields.push(self.field(Some(&oneof))?);
                        }
                    }
                }
                Some(Tok::Ident(w))
                    if ["option", "reserved", "extensions", "extend"].contains(&w.as_str()) =>
                {
                    self.skip_statement()?
                }
                Some(_) => fields.push(self.field(None)?),
                None => return Err(self.error(format!("message {name} is not closed"))),
            }
        }
        self.schema
            .messages
            .insert(name.clone(), Message { name, fields });
        Ok(())
    }

    fn field(&mut self, oneof: Option<&str>) -> Result<Field, ProtoError> {
        let mut repeated = false;
        if self.is_ident("repeated") {
            repeated = true;
            self.pos += 1;
        } else if self.is_ident("optional") || self.is_ident("required") {
            self.pos += 1;
        }
        let mut ty = self.ident()?;
        if ty == "map" && self.is_sym('<') {
            self.pos += 1;
            let key = self.ident()?;
            self.expect_sym(',')?;
            let value = self.ident()?;
            self.expect_sym('>')?;
            ty = format!("map<{key},{value}>");
        }
        let name = self.ident()?;
        self.expect_sym('=')?;
        let number = self.integer()?;
        let number = u32::try_from(number)
            .ok()
            .filter(|n| (1..=536_870_911).contains(n))
            .ok_or_else(|| self.error(format!("field {name}: bad number {number}")))?;
        if self.is_sym('[') {
            self.skip_statement()?;
        } else {
            self.expect_sym(';')?;
        }
        Ok(Field {
            name,
            number,
            ty,
            repeated,
            oneof: oneof.map(str::to_string),
        })
    }

    fn enumeration(&mut self, scope: Option<&str>) -> Result<(), ProtoError> {
        let simple = self.ident()?;
        let name = self.qualify(scope, &simple, true);
        self.expect_sym('{')?;
        let mut values = Vec::new();
        while !self.eat_sym('}') {
            if self.eat_sym(';') {
                continue;
            }
            if self.is_ident("option") || self.is_ident("reserved") {
                self.skip_statement()?;
                continue;
            }
            let value_name = self.ident()?;
            self.expect_sym('=')?;
            let number = self.integer()?;
            let number = i32::try_from(number)
                .map_err(|_| self.error(format!("enum value {value_name} out of range")))?;
            if self.is_sym('[') {
                self.skip_statement()?;
            } else {
                self.expect_sym(';')?;
            }
            values.push((value_name, number));
        }
        self.schema
            .enums
            .insert(name.clone(), Enum { name, values });
        Ok(())
    }

    fn service(&mut self) -> Result<(), ProtoError> {
        let name = self.ident()?;
        self.expect_sym('{')?;
        let mut methods = Vec::new();
        while !self.eat_sym('}') {
            if self.eat_sym(';') {
                continue;
            }
            if !self.is_ident("rpc") {
                self.skip_statement()?;
                continue;
            }
            self.pos += 1;
            let method = self.ident()?;
            let input = self.rpc_type()?;
            if !self.is_ident("returns") {
                return Err(self.error(format!("rpc {method}: expected 'returns'")));
            }
            self.pos += 1;
            let output = self.rpc_type()?;
            if self.is_sym('{') {
                self.skip_statement()?;
            } else {
                self.expect_sym(';')?;
            }
            methods.push(Method {
                name: method,
                input,
                output,
            });
        }
        self.schema
            .services
            .insert(name.clone(), Service { name, methods });
        Ok(())
    }

    fn rpc_type(&mut self) -> Result<String, ProtoError> {
        self.expect_sym('(')?;
        if self.is_ident("stream") {
            self.pos += 1;
        }
        let ty = self.ident()?;
        self.expect_sym(')')?;
        Ok(ty)
    }
}
