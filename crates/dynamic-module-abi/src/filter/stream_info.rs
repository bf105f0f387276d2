//! What Envoy knows of a request's stream: attributes, metadata, and filter state.

use super::Filter;
use crate::buffers::{copy_envoy, empty_envoy_buffer, module_buffer};
use crate::{ffi, AbiError};

/// The attributes the filter reads (CEL names in the comments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttributeId {
    /// `request.path` (with the query)
    RequestPath,
    /// `request.url_path` (without the query)
    RequestUrlPath,
    /// `request.host`
    RequestHost,
    /// `request.method`
    RequestMethod,
    /// `request.id` (x-request-id)
    RequestId,
    /// `response.code` (int)
    ResponseCode,
    /// `response.code_details`
    ResponseCodeDetails,
    /// `response.flags` (int: Envoy's response flags as a bit set)
    ResponseFlags,
    /// `source.address` (Envoy 1.40: "ip:port")
    SourceAddress,
    /// `source.port` (int)
    SourcePort,
    /// `connection.id` (int)
    ConnectionId,
    /// `upstream.request_attempt_count` (int)
    UpstreamRequestAttemptCount,
    /// `xds.cluster_name`
    XdsClusterName,
    /// `xds.route_name`
    XdsRouteName,
    /// `xds.virtual_host_name`
    XdsVirtualHostName,
}

impl AttributeId {
    fn raw(self) -> ffi::AttributeId {
        match self {
            AttributeId::RequestPath => ffi::ATTRIBUTE_REQUEST_PATH,
            AttributeId::RequestUrlPath => ffi::ATTRIBUTE_REQUEST_URL_PATH,
            AttributeId::RequestHost => ffi::ATTRIBUTE_REQUEST_HOST,
            AttributeId::RequestMethod => ffi::ATTRIBUTE_REQUEST_METHOD,
            AttributeId::RequestId => ffi::ATTRIBUTE_REQUEST_ID,
            AttributeId::ResponseCode => ffi::ATTRIBUTE_RESPONSE_CODE,
            AttributeId::ResponseCodeDetails => ffi::ATTRIBUTE_RESPONSE_CODE_DETAILS,
            AttributeId::ResponseFlags => ffi::ATTRIBUTE_RESPONSE_FLAGS,
            AttributeId::SourceAddress => ffi::ATTRIBUTE_SOURCE_ADDRESS,
            AttributeId::SourcePort => ffi::ATTRIBUTE_SOURCE_PORT,
            AttributeId::ConnectionId => ffi::ATTRIBUTE_CONNECTION_ID,
            AttributeId::UpstreamRequestAttemptCount => {
                ffi::ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT
            }
            AttributeId::XdsClusterName => ffi::ATTRIBUTE_XDS_CLUSTER_NAME,
            AttributeId::XdsRouteName => ffi::ATTRIBUTE_XDS_ROUTE_NAME,
            AttributeId::XdsVirtualHostName => ffi::ATTRIBUTE_XDS_VIRTUAL_HOST_NAME,
        }
    }
}

/// Where [`Filter::metadata_string`] looks: the `filter_metadata` of one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetadataSource {
    /// The stream's dynamic metadata (set by filters during the request).
    Dynamic,
    /// The matched route's `metadata` (None before routing or with no route).
    Route,
    /// The upstream cluster's `metadata`.
    Cluster,
    /// The chosen upstream host's (LbEndpoint) `metadata` (only once a host is chosen).
    Host,
    /// The chosen upstream host's locality (LocalityLbEndpoints) `metadata`.
    HostLocality,
}

impl MetadataSource {
    fn raw(self) -> ffi::MetadataSource {
        match self {
            MetadataSource::Dynamic => ffi::METADATA_SOURCE_DYNAMIC,
            MetadataSource::Route => ffi::METADATA_SOURCE_ROUTE,
            MetadataSource::Cluster => ffi::METADATA_SOURCE_CLUSTER,
            MetadataSource::Host => ffi::METADATA_SOURCE_HOST,
            MetadataSource::HostLocality => ffi::METADATA_SOURCE_HOST_LOCALITY,
        }
    }
}

impl Filter {
    /// A string (bytes) attribute, or None if Envoy has none now.
    pub fn attribute_string(&self, id: AttributeId) -> Option<Vec<u8>> {
        let mut value = empty_envoy_buffer();
        // SAFETY: `value` is written by Envoy.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.ptr,
                id.raw(),
                &mut value,
            )
        };
        // SAFETY: Envoy's value, valid for this hook.
        ok.then(|| unsafe { copy_envoy(value.ptr, value.length) })
    }

    /// The string at `filter_metadata.<namespace>.<key>` of `source`'s metadata, e.g. a
    /// route's `metadata: {filter_metadata: {idempotency: {rule: payments}}}` gives
    /// `metadata_string(Route, "idempotency", "rule") == Some(b"payments")`.
    ///
    /// None when Envoy has no such metadata now (no route, no upstream host yet), the
    /// namespace or key is absent, or the value is not a string (a number, bool, list or
    /// struct: Envoy also logs an error then). An empty string is `Some(vec![])`.
    pub fn metadata_string(
        &self,
        source: MetadataSource,
        namespace: &str,
        key: &str,
    ) -> Option<Vec<u8>> {
        let mut value = empty_envoy_buffer();
        // SAFETY: both buffers are read during the call; `value` is written by Envoy.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_get_metadata_string(
                self.ptr,
                source.raw(),
                module_buffer(namespace.as_bytes()),
                module_buffer(key.as_bytes()),
                &mut value,
            )
        };
        if !ok {
            None
        } else if value.length == 0 {
            Some(Vec::new())
        } else if value.ptr.is_null() {
            // "Found" with bytes that cannot be read: nothing to trust.
            None
        } else {
            // SAFETY: Envoy's string, valid for this hook; copied before it returns.
            Some(unsafe { copy_envoy(value.ptr, value.length) })
        }
    }

    /// An integer attribute, or None if Envoy has none now.
    pub fn attribute_int(&self, id: AttributeId) -> Option<u64> {
        let mut value: u64 = 0;
        // SAFETY: `value` is written by Envoy.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_get_attribute_int(
                self.ptr,
                id.raw(),
                &mut value,
            )
        };
        ok.then_some(value)
    }

    /// Sets a bytes filter state object (readable in the access log as
    /// `%FILTER_STATE(name:PLAIN)%`).
    pub fn set_filter_state(&self, name: &str, value: &[u8]) -> Result<(), AbiError> {
        // SAFETY: both buffers are read during the call.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_set_filter_state_bytes(
                self.ptr,
                module_buffer(name.as_bytes()),
                module_buffer(value),
            )
        };
        ok.then_some(())
            .ok_or(AbiError::Refused("set_filter_state_bytes"))
    }
}
