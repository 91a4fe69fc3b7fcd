// Swagger UI on this server's OpenAPI document. A file of its own, not an inline script: the page is
// served under a CSP that allows scripts from this origin only (api/docs_pages.py).
// No validator badge (it would load an image from validator.swagger.io); authorizations stay in the
// page's memory (never persisted: the console's key storage is the only one on this origin).
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: new URL("../openapi.json", document.baseURI).href,
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    validatorUrl: null,
    persistAuthorization: false,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
});
