//! The protobuf wire format without a schema: varints, field keys, length-delimited fields, and
//! [`raw_fields`] iterating over the `(number, value)` pairs of an encoded message (groups skipped).
//! Used by [`super::codec`] and by hand-written envelopes such as ttrpc's.

/// Protobuf wire types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireType {
    /// 0: int32, int64, uint32, uint64, sint32, sint64, bool, enum.
    Varint = 0,
    /// 1: fixed64, sfixed64, double.
    Fixed64 = 1,
    /// 2: string, bytes, messages, packed repeated fields, map entries.
    Len = 2,
    /// 3: deprecated group start.
    StartGroup = 3,
    /// 4: deprecated group end.
    EndGroup = 4,
    /// 5: fixed32, sfixed32, float.
    Fixed32 = 5,
}

/// One field value as found on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawValue<'a> {
    /// A varint.
    Varint(u64),
    /// Eight little-endian bytes.
    Fixed64(u64),
    /// A length-delimited payload.
    Len(&'a [u8]),
    /// Four little-endian bytes.
    Fixed32(u32),
    /// The raw contents of a group.
    Group(&'a [u8]),
}

/// Appends `v` as a varint.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends a field key.
pub fn put_key(out: &mut Vec<u8>, number: u32, wire: WireType) {
    put_varint(out, (u64::from(number) << 3) | wire as u64);
}

/// Appends a varint field (key and value).
pub fn put_varint_field(out: &mut Vec<u8>, number: u32, v: u64) {
    put_key(out, number, WireType::Varint);
    put_varint(out, v);
}

/// Appends a length-delimited field (key, length, data).
pub fn put_len_field(out: &mut Vec<u8>, number: u32, data: &[u8]) {
    put_key(out, number, WireType::Len);
    put_varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// Reads a varint at `*pos`, advancing it; `None` when truncated or longer than ten bytes.
pub fn read_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..70).step_by(7) {
        let byte = *buf.get(*pos)?;
        *pos += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

/// Iterates over the `(field number, value)` pairs of an encoded message.
pub fn raw_fields(buf: &[u8]) -> RawFields<'_> {
    RawFields {
        buf,
        pos: 0,
        failed: false,
    }
}

/// Iterator returned by [`raw_fields`]; yields one error and stops on malformed input.
#[derive(Debug)]
pub struct RawFields<'a> {
    buf: &'a [u8],
    pos: usize,
    failed: bool,
}

impl<'a> RawFields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| format!("{n} bytes announced at offset {}, past the end", self.pos))?;
        let slice = &self.buf[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn read(&mut self) -> Result<(u32, RawValue<'a>), String> {
        let (number, wire) = self.key()?;
        let value = match wire {
            0 => RawValue::Varint(self.varint()?),
            1 => RawValue::Fixed64(u64::from_le_bytes(fixed(self.take(8)?)?)),
            2 => {
                let len = usize::try_from(self.varint()?).map_err(|e| e.to_string())?;
                RawValue::Len(self.take(len)?)
            }
            3 => {
                let start = self.pos;
                loop {
                    let before = self.pos;
                    let (n, w) = self.key()?;
                    if w == 4 {
                        if n != number {
                            return Err(format!("group {number} ended by end-group {n}"));
                        }
                        break RawValue::Group(&self.buf[start..before]);
                    }
                    self.pos = before;
                    self.read()?;
                }
            }
            5 => RawValue::Fixed32(u32::from_le_bytes(fixed(self.take(4)?)?)),
            other => return Err(format!("field {number}: invalid wire type {other}")),
        };
        Ok((number, value))
    }

    fn varint(&mut self) -> Result<u64, String> {
        read_varint(self.buf, &mut self.pos)
            .ok_or_else(|| format!("truncated or overlong varint at offset {}", self.pos))
    }

    fn key(&mut self) -> Result<(u32, u64), String> {
        let key = self.varint()?;
        let number = u32::try_from(key >> 3)
            .ok()
            .filter(|&n| n != 0)
            .ok_or_else(|| format!("invalid field number {}", key >> 3))?;
        Ok((number, key & 7))
    }
}

pub(super) fn fixed<const N: usize>(bytes: &[u8]) -> Result<[u8; N], String> {
    bytes
        .try_into()
        .map_err(|_| "short fixed-width value".to_string())
}

impl<'a> Iterator for RawFields<'a> {
    type Item = Result<(u32, RawValue<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.buf.len() {
            return None;
        }
        let item = self.read();
        self.failed = item.is_err();
        Some(item)
    }
}
