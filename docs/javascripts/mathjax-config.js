// MathJax 3 (served from this site: assets/mathjax/, copied from the docs extra at build time).
// Ordinary pages: pymdownx.arithmatex wraps maths in .arithmatex as \(…\) and \[…\].
// Notebook pages: the markdown cells keep $…$ and $$…$$ inside .jp-RenderedMarkdown.
// Code (pre, code), notebook outputs other than markdown/LaTeX, and the theme's navigation,
// header, footer and search are not scanned: their dollar signs stay text.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass:
      "tex2jax_ignore|md-nav|md-header|md-footer|md-search|md-sidebar|highlight|" +
      "highlight-ipynb|jp-OutputArea-output|jp-InputArea-editor",
    processHtmlClass: "tex2jax_process|arithmatex|jp-RenderedMarkdown|jp-RenderedLatex",
  },
  svg: { fontCache: "global" },
};
