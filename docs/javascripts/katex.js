// Renders the formulas pymdownx.arithmatex marks (\( \) inline, \[ \] display) with the KaTeX that
// `scripts/docs` vendors; on every page Material shows (document$), and not at all without KaTeX.
document$.subscribe(({ body }) => {
  if (typeof renderMathInElement !== "function") return;
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
