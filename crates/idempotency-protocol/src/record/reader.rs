//! Bounds-checked reading of the binary encodings (table buckets, recorded responses).
//! Anything short or malformed yields None, never a panic.

pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }

    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let head = self.bytes.get(..n)?;
        self.bytes = self.bytes.get(n..)?;
        Some(head)
    }

    pub fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    pub fn u8(&mut self) -> Option<u8> {
        Some(u8::from_be_bytes(self.array()?))
    }

    pub fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.array()?))
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}
